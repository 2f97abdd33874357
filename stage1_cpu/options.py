"""Stage 1's command-line options and engine builder (chat, serve, generate): no heavy
imports, `--help` is quick."""
from __future__ import annotations

import argparse
from pathlib import Path

from common.config import gguf_path
from common.models import resolve_model


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("stage 1 (CPU)")
    g.add_argument("--quant", choices=("none", "bf16", "int8", "int4", "stored"), default=None,
                   help="weight format: none = float32, bf16, or group-quantized int8 / int4 "
                   "(smaller and faster to read); stored = a GGUF file's blocks as they are "
                   "(docs/gguf.md). Default: stored for a GGUF file, none for a folder")
    g.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128), metavar="G",
                   help="weights sharing one scale in int8 / int4 (default 32, like llama.cpp's "
                   "Q8_0 / Q4_1)")
    g.add_argument("--kernels", choices=("auto", "plain", "fast"), default="auto",
                   help="plain: the readable core kernels, on any CPU; fast: stage1_cpu/fast/ (one "
                   "parallel region per decode step, the CPU's int8 / bf16 dot products where it "
                   "has them); auto: fast wherever it runs (default)")
    g.add_argument("--activations", choices=("auto", "int8", "fp32"), default="auto",
                   help="fast kernels, int8 / int4 weights: round the activations to int8 and "
                   "multiply integers (as llama.cpp does). auto: at decode where the CPU has an "
                   "int8 dot product (VNNI or AVX2), the lm_head at int16; at prefill int16 (the "
                   "integer GEMM), bf16 weights bf16 where AVX-512 BF16 exists; int8: everywhere, "
                   "prefill through the integer GEMM included; fp32: never (default auto)")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="numba threads (default: all cores)")
    g.add_argument("--speculative", choices=("ngram",),
                   help="speculative decoding, drafts by prompt lookup")
    g.add_argument("--draft-model", metavar="DIR|GGUF",
                   help="speculative decoding, drafts by a smaller model")
    g.add_argument("--draft-tokens", type=int, metavar="K",
                   help="drafted tokens per step at most (default 7)")


def build_engine(folder: Path, args: argparse.Namespace, progress: bool = True):
    from .engine import LLMEngine   # here, so --help does not wait for numba
    if (getattr(args, "slots", None) not in (None, 1)
            or getattr(args, "token_budget", None) is not None):
        print("note: stage 1 serves one sequence at a time; --slots and --token-budget are ignored",
              flush=True)
    kw = dict(quant=quant_for(folder, args), group_size=args.group_size, max_ctx=args.max_ctx,
              threads=args.threads, progress=progress, kernels=args.kernels,
              activations=args.activations)
    if args.speculative or args.draft_model:       # speculative.py loads only with its flags
        from .speculative import SpeculativeEngine
        return SpeculativeEngine.from_args(folder, args, kw, quant_for)
    return LLMEngine(folder, **kw)


def quant_for(folder: Path, args: argparse.Namespace) -> str:
    """--quant, or its default: a GGUF file's blocks as stored, a folder's float32."""
    return args.quant or ("stored" if gguf_path(folder) else "none")


def describe(args: argparse.Namespace) -> str:
    """A few words for the banner (the engine's describe_kernels() adds which kernels it chose)."""
    q = args.quant or quant_for(resolve_model(getattr(args, "model", None), progress=False), args)
    quant = {"none": "float32", "stored": "GGUF as stored"}.get(q, q)
    if args.quant in ("int8", "int4") and getattr(args, "activations", "auto") != "auto":
        quant += f" · {args.activations} activations"
    return f"stage 1 CPU · {quant}" + (f" · {args.threads} threads" if args.threads else "")
