"""Stage 2's command-line options and engine builder, shared by chat and serve.

Changed from stage 1: the options are the device and the paged KV cache instead
of quantization and threads; --slots and --token-budget (common flags of the
server) now matter. Kept free of heavy imports so that `--help` answers at once.
"""
from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_SLOTS, DEFAULT_TOKEN_BUDGET = 256, 8192


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("stage 2 (batched, paged KV cache)")
    g.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: CuPy and the CUDA kernels; cpu: numpy twins, slow (default cuda)")
    g.add_argument("--page-size", type=int, default=256, metavar="P",
                   help="positions per KV page (default 256)")
    g.add_argument("--kv-memory", type=float, default=None, metavar="GIB",
                   help="GiB for the KV page pool (default: most of the free GPU "
                        "memory; 1 GiB on cpu)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    slots = getattr(args, "slots", None) or DEFAULT_SLOTS
    budget = getattr(args, "token_budget", None) or max(DEFAULT_TOKEN_BUDGET, slots)
    kv = None if args.kv_memory is None else int(args.kv_memory * 2**30)
    return dict(max_ctx=args.max_ctx, slots=slots, token_budget=budget, page_size=args.page_size,
                kv_memory=kv, device=args.device)


def build_engine(folder: Path, args: argparse.Namespace, progress: bool = True):
    from .engine import LLMEngine   # here, so --help does not wait for CuPy
    return LLMEngine(folder, progress=progress, **engine_kwargs(args))


def describe(args: argparse.Namespace) -> str:
    return f"stage 2 batched · {args.device} · float32"
