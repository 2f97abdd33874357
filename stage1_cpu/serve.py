"""python -m stage1_cpu.serve --model DIR [--quant int8|int4|none] [--addr 127.0.0.1:8000]

The OpenAI-compatible server (common/server.py, command line: common/serve_cli.py) over the stage-1 CPU engine.
This file only builds the engine: HTTP, templates, tokenization, parsing and
streaming are the same for every stage. Stage 1 runs one sequence at a time, so
--slots and --token-budget have no effect here; concurrent requests wait in its
FIFO queue.

With --engine-process the engine runs in a child process (a crash in compiled code
then fails only the requests in flight; docs/server.md measures its cost), which
imports build_engine by its module and name: it stays a module-level function.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from common.serve_cli import main as serve_main
from .options import add_args
from .options import build_engine as _build


def build_engine(folder: Path, args: argparse.Namespace):
    if args.slots not in (None, 1) or args.token_budget is not None:
        print("note: stage 1 serves one sequence at a time; --slots and --token-budget are ignored", flush=True)
    return _build(folder, args)


def main(argv: list[str] | None = None) -> None:
    serve_main(build_engine, argv, prog="python -m stage1_cpu.serve", add_args=add_args)


if __name__ == "__main__":
    main()
