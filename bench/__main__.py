"""python -m bench <name> [options]: run one benchmark (see bench/__init__.py)."""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "cpu": "bench.cpu",          # stage 1 against llama.cpp, transformers and the roofline
    "ladder": "bench.ladder",    # the ablation ladder: naive matmul -> threads -> fused -> int4 -> int8 activations
    "kernels": "bench.kernels",  # the stage-1 matmul kernels on their own
    "profile": "bench.profile",  # one stage-1 forward pass, op by op
    "prefill-pair": "bench.prefill_pair",   # prefill, stage 1 against llama.cpp, interleaved: one ratio per round
    "moe": "bench.moe",          # the MoE benchmark: stage 1 against llama.cpp (qwen3moe) and transformers
    "gpu": "bench.gpu",          # stages 2 and 3 on a GPU: nano-vllm's workload, batch-1 decode (bench/gpu_check.sh)
    "lessons": "bench.lessons",  # the stage 2 -> 3 lesson ladder, counted on CPU per rung (docs/lessons/stage3)
    "figures": "bench.figures",  # the figures of docs/ (docs/figures/*.svg), drawn from saved JSON results
    "first-answer": "bench.first_answer",   # how often the default model's first answer is right, per sampling setting
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark {argv[0]!r}", file=sys.stderr)
        print("usage: python -m bench {" + ",".join(BENCHMARKS) + "} [options]   (--help after the name for its options)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        module = importlib.import_module(BENCHMARKS[argv[0]])
    except ImportError as e:
        print(f"benchmark {argv[0]!r} is not available: {e}", file=sys.stderr)
        return 2
    # each benchmark parses sys.argv itself, as it does when run as python -m bench.<name>
    sys.argv = [f"python -m bench {argv[0]}"] + argv[1:]
    return module.main() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
