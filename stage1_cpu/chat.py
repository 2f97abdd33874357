"""python -m stage1_cpu.chat [--model DIR|NAME] [--quant none|bf16|int8|int4] [--threads N]

The chat itself is common/chat.py, the same for every stage; this file hands it stage 1's
options and engine."""
from __future__ import annotations

import sys

from common.chat import main as chat_main
from . import options


def build_engine(folder, args):
    # progress bars only on a terminal: piped, stdout carries the answers and nothing else
    return options.build_engine(folder, args, progress=sys.stdout.isatty())


def main(argv: list[str] | None = None) -> int:
    return chat_main(build_engine, argv, prog="python -m stage1_cpu.chat",
                     add_args=options.add_args, describe=options.describe)


if __name__ == "__main__":
    sys.exit(main())
