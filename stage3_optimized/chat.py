"""The terminal chat on the stage-3 engine:

    python -m stage3_optimized.chat [--model DIR|NAME] [--device cuda|cpu] [--page-size P]
                                    [--kv-memory GIB] [--no-prefix-caching]

Changed from stage 2: only the engine and its options (options.py). The chat itself
is common/chat.py; one user means a batch of one, but a conversation's earlier turns
are a prefix of the next prompt, so the prefix cache skips them.
"""
from __future__ import annotations

import sys

from common.chat import main as chat_main
from . import options


def build_engine(folder, args):
    return options.build_engine(folder, args, progress=sys.stdout.isatty())


def main(argv: list[str] | None = None) -> int:
    return chat_main(build_engine, argv, prog="python -m stage3_optimized.chat",
                     add_args=options.add_args, describe=options.describe)


if __name__ == "__main__":
    sys.exit(main())
