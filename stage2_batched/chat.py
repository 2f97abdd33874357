"""The terminal chat on the stage-2 batched engine:

    python -m stage2_batched.chat [--model DIR|NAME] [--device cuda|cpu] [--page-size P] [--kv-memory GIB]

Changed from stage 1: the stage's options are the device and the paged KV cache
instead of quantization and threads. The chat itself (conversation, template,
streaming, /commands) is common/chat.py; one user means a batch of one, so this is
mostly a way to try the engine by hand.
"""
from __future__ import annotations

import argparse
import sys

from common.chat import main as chat_main


def add_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("stage 2 (batched, paged KV cache)")
    g.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: CuPy and the CUDA kernels; cpu: their numpy twins (slow, for checking)")
    g.add_argument("--page-size", type=int, default=256, metavar="P", help="positions per KV page (default 256)")
    g.add_argument("--kv-memory", type=float, default=None, metavar="GIB",
                   help="GiB for the KV page pool (default: most of the free GPU memory; 1 GiB on cpu)")


def build_engine(folder, args):
    from stage2_batched.engine import LLMEngine   # here, so --help does not wait for CuPy
    kv = None if args.kv_memory is None else int(args.kv_memory * 2**30)
    return LLMEngine(folder, max_ctx=args.max_ctx, slots=4, token_budget=2048, page_size=args.page_size,
                     kv_memory=kv, device=args.device)


def describe(args) -> str:
    return f"stage 2 batched · {args.device} · float32"


def main(argv: list[str] | None = None) -> int:
    return chat_main(build_engine, argv, prog="python -m stage2_batched.chat", add_args=add_args, describe=describe)


if __name__ == "__main__":
    sys.exit(main())
