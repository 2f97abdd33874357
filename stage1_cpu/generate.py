"""python -m stage1_cpu.generate --model DIR|NAME --prompt "...": the tokens as they arrive,
then prefill and decode speed (common/generate.py; this file hands it stage 1's engine)."""
from __future__ import annotations

import sys

from common.generate import main as generate_main

from .options import add_args, build_engine


def main(argv=None) -> int:
    return generate_main(build_engine, argv, prog="python -m stage1_cpu.generate",
                         add_args=add_args)


if __name__ == "__main__":
    sys.exit(main())
