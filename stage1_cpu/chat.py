"""The terminal chat on the stage-1 CPU engine:

    python -m stage1_cpu.chat [--model DIR|NAME] [--quant none|bf16|int8|int4] [--threads N]

The chat itself (conversation, template, streaming, /commands) is common/chat.py;
this file only adds stage 1's options and builds its engine, so every stage gets
the same chat.
"""
from __future__ import annotations

import argparse
import sys

from common.chat import main as chat_main


def add_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("stage 1 (CPU)")
    g.add_argument("--quant", choices=["none", "bf16", "int8", "int4"], default="none",
                   help="weight format: none = float32 as loaded, bf16, or group-quantized int8 / int4 "
                        "(smaller and faster to read; default none)")
    g.add_argument("--group-size", type=int, default=64, metavar="G",
                   help="weights per quantization scale for int8 / int4 (default 64)")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="numba threads (default: all cores)")


def build_engine(folder, args):
    from stage1_cpu.engine import LLMEngine   # here, so --help does not wait for numba
    # progress bars only on a terminal: piped, stdout carries the answers and nothing else
    return LLMEngine(folder, quant=args.quant, group_size=args.group_size, max_ctx=args.max_ctx,
                     threads=args.threads, progress=sys.stdout.isatty())


def describe(args) -> str:
    quant = "float32" if args.quant == "none" else args.quant
    return f"stage 1 CPU · {quant}" + (f" · {args.threads} threads" if args.threads else "")


def main(argv: list[str] | None = None) -> int:
    return chat_main(build_engine, argv, prog="python -m stage1_cpu.chat", add_args=add_args, describe=describe)


if __name__ == "__main__":
    sys.exit(main())
