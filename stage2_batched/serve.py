"""python -m stage2_batched.serve --model DIR [--addr 127.0.0.1:8000] [--slots N]
    [--token-budget N]

The OpenAI-compatible server (common/server.py, command line: common/serve_cli.py) over the
stage-2 batched engine.
Changed from stage 1: --slots and --token-budget now matter (every concurrent
request joins the running batch), plus the paged KV cache's options. This file
only builds the engine: HTTP, templates, tokenization, parsing and streaming are
the same for every stage.

With --engine-process the engine runs in a child process, which imports
build_engine by its module and name: it stays a module-level function.
"""
from __future__ import annotations

from common.serve_cli import main as serve_main
from .options import add_args, build_engine


def main(argv: list[str] | None = None) -> None:
    serve_main(build_engine, argv, prog="python -m stage2_batched.serve", add_args=add_args)


if __name__ == "__main__":
    main()
