"""One-shot generation: python -m stage3_optimized.generate --model DIR|NAME --prompt "..." [--n N]

Changed from stage 1's generate.py (stage 2 has none): the stage-3 engine and its
options (device, pages, --no-prefix-caching, --no-cuda-graphs), and --n copies of the prompt sent at
once, which shows batching and the prefix cache from the command line: the copies
after the first find the prompt's full pages cached. Prints the first copy's tokens
as they arrive, then the step counts and output speed.
"""
from __future__ import annotations

import argparse
import sys
import time

from common.chat_template import ChatTemplate
from common.engine import Request
from common.models import resolve_model
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from .options import add_args, build_engine


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stage3_optimized.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model folder or known name (default: smollm2-135m)")
    ap.add_argument("--prompt", required=True, help="the text to continue / the user message")
    ap.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    ap.add_argument("--no-think", action="store_true", help="Qwen3: render the template with enable_thinking=False")
    add_args(ap)
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--n", type=int, default=1, help="send the prompt N times at once (default 1)")
    ap.add_argument("--slots", type=int, default=None, help="sequences admitted at once (default 256)")
    ap.add_argument("--token-budget", type=int, default=None, help="tokens per step (default 8192)")
    args = ap.parse_args(argv)

    try:
        if args.n < 1:
            raise ValueError("--n must be at least 1")
        folder = resolve_model(args.model)
        tok = Tokenizer(folder)
        if args.raw:
            text = args.prompt
        else:
            text = ChatTemplate.from_folder(folder).render(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                enable_thinking=not args.no_think)
        params = SamplingParams.from_generation_config(
            folder, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        engine = build_engine(folder, args, progress=sys.stderr.isatty())
        ids = tok.encode(text)
        for i in range(args.n):
            engine.add_request(Request(f"generate-{i}", ids, params))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    detok = tok.detokenizer()
    n_out = 0
    t0 = time.perf_counter()
    failed = False
    while engine.has_work():
        for ev in engine.step():
            failed |= ev.finish_reason == "error"
            if ev.finish_reason not in ("stop", "abort", "error"):   # those carry no answer text
                n_out += 1
                if ev.request_id == "generate-0":
                    sys.stdout.write(detok.add(ev.token_id))
                    sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    if failed:
        print("error: the engine could not go on (its logits were not finite)", file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    cached = sum(engine.num_cached_tokens(f"generate-{i}") for i in range(args.n))
    print(f"[{args.n} x {len(ids)} prompt tokens ({cached} from the prefix cache), {n_out} generated "
          f"in {engine.num_steps} steps | {n_out / max(wall, 1e-9):.1f} output tok/s, {wall:.2f} s]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
