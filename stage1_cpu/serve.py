"""python -m stage1_cpu.serve --model DIR [--quant int8|int4|none] [--addr 127.0.0.1:8000]

The OpenAI-compatible server (common/serve_cli.py, the same for every stage) over the stage-1
engine, one sequence at a time: concurrent requests wait in its FIFO queue, and --slots and
--token-budget have no effect (options.build_engine says so). With --engine-process the engine
runs in a child process (docs/server.md), which imports build_engine by name: it stays module-level.
"""
from __future__ import annotations

from common.serve_cli import main as serve_main
from .options import add_args, build_engine


def main(argv: list[str] | None = None) -> None:
    serve_main(build_engine, argv, prog="python -m stage1_cpu.serve", add_args=add_args)


if __name__ == "__main__":
    main()
