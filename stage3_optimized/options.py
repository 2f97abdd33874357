"""Stage 3's command-line options and engine builder, shared by chat, generate and serve.

Changed from stage 2: the banner names the rung (RUNG); --no-prefix-caching turns the
prefix cache off and --no-cuda-graphs the decode graphs (every step launched kernel by
kernel); the rest are stage 2's flags (device, page size, KV memory; --slots and
--token-budget from the server). Kept free of heavy imports so that `--help` answers at
once.
"""
from __future__ import annotations

import argparse
from pathlib import Path

RUNG = "stage 3 optimized"                   # = stage 2 + lessons 01-17 (docs/lessons/stage3)
DEFAULT_SLOTS, DEFAULT_TOKEN_BUDGET = 256, 8192


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(RUNG)
    g.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: CuPy and the CUDA kernels; cpu: numpy twins, slow (default cuda)")
    g.add_argument("--page-size", type=int, default=256, metavar="P",
                   help="positions per KV page (default 256)")
    g.add_argument("--kv-memory", type=float, default=None, metavar="GIB",
                   help="GiB for the KV page pool (default: most of the free GPU "
                        "memory; 1 GiB on cpu)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt in full instead of reusing the KV pages of "
                        "a common prefix")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="launch every decode step kernel by kernel instead of replaying a "
                        "captured CUDA graph")


def engine_kwargs(args: argparse.Namespace) -> dict:
    slots = getattr(args, "slots", None) or DEFAULT_SLOTS
    budget = getattr(args, "token_budget", None) or max(DEFAULT_TOKEN_BUDGET, slots)
    kv = None if args.kv_memory is None else int(args.kv_memory * 2**30)
    return dict(max_ctx=args.max_ctx, slots=slots, token_budget=budget, page_size=args.page_size,
                kv_memory=kv, device=args.device,
                enable_prefix_caching=getattr(args, "prefix_caching", True),
                enforce_eager=not getattr(args, "cuda_graphs", True))


def build_engine(folder: Path, args: argparse.Namespace, progress: bool = True):
    from .engine import LLMEngine   # here, so --help does not wait for CuPy
    return LLMEngine(folder, progress=progress, **engine_kwargs(args))


def describe(args: argparse.Namespace) -> str:
    cache = "prefix cache" if getattr(args, "prefix_caching", True) else "no prefix cache"
    graphs = " · cuda graphs" if args.device == "cuda" and getattr(args,
                                                                   "cuda_graphs", True) else ""
    return f"{RUNG} · {args.device} · bf16 · {cache}{graphs}"
