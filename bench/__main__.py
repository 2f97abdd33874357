"""python -m bench <command> [options]: run one benchmark; `python -m bench --help` lists them."""
from __future__ import annotations

import importlib
import sys

# command -> (module, what it measures); every file of bench/ serves one of these
COMMANDS = {
    "cpu": ("bench.cpu",
            "stage 1 against llama.cpp and the roofline, "
            "logits against transformers, dense or MoE"),
    "ladder": ("bench.ladder",
               "the ablation ladder: naive matmul -> threads -> fused -> int4 -> int8 activations"),
    "profile": ("bench.profile",
                "one stage-1 forward pass, op by op; "
                "a prefill's GEMM against its instruction's peak"),
    "report": ("bench.report",
               "the results tables of README.md and docs/, written from saved JSON (--check)"),
    "figures": ("bench.figures",
                "the figures of docs/ (docs/figures/*.svg), drawn from saved JSON results"),
    "gpu": ("bench.gpu",
            "stages 2 and 3 on a GPU: nano-vllm's workload, batch-1 decode (bench/gpu_check.sh)"),
    "serve": ("bench.serve",
              "an OpenAI server under streamed load (TTFT, TPOT, ITL), "
              "stage 1 against llama.cpp's"),
    "lessons": ("bench.lessons",
                "the stage 2 -> 3 lesson ladder, counted on CPU per rung (docs/lessons/stage3)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "\n".join(["usage: python -m bench <command> [options]   (--help after a command "
                      "for its options)", "",
                      "commands:",
                      *(f"  {name:{width}}  {what}" for name, (_, what) in COMMANDS.items())])


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[argv[0]][0])
    except ImportError as e:
        print(f"benchmark {argv[0]!r} is not available: {e}", file=sys.stderr)
        return 2
    # each benchmark parses sys.argv itself, as it does when run as python -m bench.<name>
    sys.argv = [f"python -m bench {argv[0]}"] + argv[1:]
    return module.main() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
