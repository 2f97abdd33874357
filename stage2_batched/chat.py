"""The terminal chat on the stage-2 batched engine:

    python -m stage2_batched.chat [--model DIR|NAME] [--device cuda|cpu] [--page-size P]
    [--kv-memory GIB]

Changed from stage 1: the options come from stage2_batched/options.py (device and
paged KV cache). The chat itself is common/chat.py; one user means a batch of
one, so this is mostly a way to try the engine by hand.
"""
from __future__ import annotations

import sys

from common.chat import main as chat_main
from . import options


def build_engine(folder, args):
    return options.build_engine(folder, args, progress=sys.stdout.isatty())


def main(argv: list[str] | None = None) -> int:
    return chat_main(build_engine, argv, prog="python -m stage2_batched.chat",
                     add_args=options.add_args, describe=options.describe)


if __name__ == "__main__":
    sys.exit(main())
