"""python -m stage3_optimized.generate --model DIR|NAME --prompt "..." [--n N]: the tokens as they
arrive, then the speed and the prompt tokens found in the prefix cache (common/generate.py).

Changed from stage 1's generate.py (stage 2 has none): stage 3's engine and its options
(options.py) and the size of its batches (--slots, --token-budget). With --n N copies of the
prompt at once, the copies after the first find the prompt's full pages cached.
"""
from __future__ import annotations

import argparse
import sys

from common.generate import main as generate_main

from .options import add_args, build_engine


def add_generate_args(ap: argparse.ArgumentParser) -> None:
    """Stage 3's options, and the batch's size (the server adds these two itself)."""
    add_args(ap)
    ap.add_argument("--slots", type=int, default=None,
                    help="sequences admitted at once (default 256)")
    ap.add_argument("--token-budget", type=int, default=None, help="tokens per step (default 8192)")


def main(argv=None) -> int:
    return generate_main(build_engine, argv, prog="python -m stage3_optimized.generate",
                         add_args=add_generate_args)


if __name__ == "__main__":
    sys.exit(main())
