"""python -m stage2_batched.serve --model DIR [--addr 127.0.0.1:8000] [--slots N] [--token-budget N]

The OpenAI-compatible server (common/server.py) over the stage-2 batched engine.
Changed from stage 1: --slots and --token-budget now matter (every concurrent
request joins the running batch), plus the paged KV cache's options. This file
only builds the engine: HTTP, templates, tokenization, parsing and streaming are
the same for every stage.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from common.server import main as serve_main

DEFAULT_SLOTS, DEFAULT_TOKEN_BUDGET = 256, 8192


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("stage 2 (batched, paged KV cache)")
    g.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: CuPy and the CUDA kernels; cpu: their numpy twins (slow, for checking)")
    g.add_argument("--page-size", type=int, default=256, metavar="P", help="positions per KV page (default 256)")
    g.add_argument("--kv-memory", type=float, default=None, metavar="GIB",
                   help="GiB for the KV page pool (default: most of the free GPU memory; 1 GiB on cpu)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    slots = getattr(args, "slots", None) or DEFAULT_SLOTS
    budget = getattr(args, "token_budget", None) or max(DEFAULT_TOKEN_BUDGET, slots)
    kv = None if args.kv_memory is None else int(args.kv_memory * 2**30)
    return dict(max_ctx=args.max_ctx, slots=slots, token_budget=budget, page_size=args.page_size,
                kv_memory=kv, device=args.device)


def build_engine(folder: Path, args: argparse.Namespace):
    from stage2_batched.engine import LLMEngine   # here, so --help does not wait for CuPy
    return LLMEngine(folder, **engine_kwargs(args))


def main(argv: list[str] | None = None) -> None:
    serve_main(build_engine, argv, prog="python -m stage2_batched.serve", add_args=add_args)


if __name__ == "__main__":
    main()
