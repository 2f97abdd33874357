"""One-shot generation for any Engine: `python -m stage1_cpu.generate --model DIR|NAME --prompt
"..." [--n N]` prints the tokens as they arrive (the prompt through the chat template unless --raw),
then the speed (stage 1: prefill and decode apart; else output tok/s and the prompt tokens a prefix
cache held) and whether the token limit cut the answer. --n sends the prompt N times at once."""
from __future__ import annotations

import argparse
import sys
import time

from common.engine import Request
from common.models import resolve_model
from common.sampling import SamplingParams, generation_defaults
from common.stopping import AnswerText
from common.tokenizer import Tokenizer


def parser(prog: str, add_args=None) -> argparse.ArgumentParser:
    """The command line; add_args(parser) adds the stage's options."""
    ap = argparse.ArgumentParser(prog=prog,
                                 description="One-shot generation: the prompt in, tokens out.")
    ap.add_argument("--model", default=None,
                    help="HF model folder or known name (default: smollm2-135m)")
    ap.add_argument("--prompt", required=True, help="the text to continue / the user message")
    ap.add_argument("--raw", action="store_true",
                    help="feed the prompt as is, without the chat template")
    ap.add_argument("--no-think", action="store_true",
                    help="Qwen3: render the template with enable_thinking=False")
    if add_args:
        add_args(ap)
    ap.add_argument("--max-ctx", type=int, default=4096, help="tokens in all (default 4096)")
    ap.add_argument("--max-tokens", type=int, default=None, help="answer tokens at most (default: "
                    "max_new_tokens in the model's generation_config.json, else 256)")
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--min-p", type=float, default=None)
    ap.add_argument("--repetition-penalty", type=float, default=None)
    ap.add_argument("--presence-penalty", type=float, default=None,
                    help="0 turns the default model's off")
    ap.add_argument("--frequency-penalty", type=float, default=None)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-turn token")
    ap.add_argument("--n", type=int, default=1, help="send the prompt N times at once (default 1)")
    return ap


def chat_prompt(folder, args) -> str:
    """The prompt as a user turn of the model's chat template. The template's module (Jinja and
    transformers' rendering rules) is imported here, when a prompt is rendered: --raw starts
    sooner without Jinja, and a first reading of stage 1 (`--raw`) goes from text to tokens
    without it."""
    from common.chat_template import ChatTemplate
    return ChatTemplate.from_folder(folder).render(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
        enable_thinking=not args.no_think)


def main(build_engine, argv=None, prog="python -m stage1_cpu.generate", add_args=None) -> int:
    """build_engine(folder, args, progress) -> an engine; add_args as parser's."""
    args = parser(prog, add_args).parse_args(argv)

    try:
        if args.n < 1:
            raise ValueError("--n must be at least 1")
        folder = resolve_model(args.model)
        tok = Tokenizer(folder)
        text = args.prompt if args.raw else chat_prompt(folder, args)
        params = SamplingParams.from_defaults(      # 256 tokens where no one says how many
            {"max_tokens": 256, **generation_defaults(folder)}, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos)
        # piped: stdout is the text alone
        engine = build_engine(folder, args, progress=sys.stdout.isatty())
        kernels = [engine.describe_kernels()] if hasattr(engine, "describe_kernels") else []
        print(f"[{' · '.join([folder.name, *kernels])}]", file=sys.stderr)  # the model, its kernels
        if hasattr(engine, "warm_up") and engine.kernels_cold():
            print("compiling kernels, first run only ...", file=sys.stderr, flush=True)
            print(f"compiled kernels in {engine.warm_up():.1f} s", file=sys.stderr)
        ids = tok.encode(text)
        for i in range(args.n):
            engine.add_request(Request(f"generate-{i}", ids, params))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    # the first copy's events -> text, the end-of-turn id left out
    answer = AnswerText(tok.detokenizer())
    n_out, failed, finish = 0, False, None     # answer tokens of every copy; how the first ends
    t0 = time.perf_counter()
    while engine.has_work():
        for ev in engine.step():
            failed |= ev.finish_reason == "error"
            # those carry no answer text
            n_out += ev.finish_reason not in ("stop", "abort", "error")
            if ev.request_id == "generate-0":
                sys.stdout.write(answer.feed(ev))
                sys.stdout.flush()
                finish = ev.finish_reason or finish
    sys.stdout.write("\n")
    if failed:
        print("error: the engine could not go on (its logits were not finite)", file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    cut = finish == "length"          # said, as the chat says it: else it reads as the answer's end
    took = f"{wall:.2f} s" + (f", cut at the token limit ({params.max_tokens})" if cut else "")
    spec = getattr(engine, "last_speculation", None)        # an engine with speculative decoding
    # stage 1: prefill and decode timed apart
    if hasattr(engine, "last_prefill_tokens") and args.n == 1:
        pf = engine.last_prefill_tokens / max(engine.last_prefill_s, 1e-9)
        dc = engine.last_decode_tokens / max(engine.last_decode_s, 1e-9)
        print(f"[{len(ids)} prompt tokens, {n_out} generated | prefill {pf:.1f} tok/s, "
              f"decode {dc:.1f} tok/s" + (f", {spec.line()}" if spec else "") + f", {took}]",
              file=sys.stderr)
    else:
        cached = (f" ({sum(engine.num_cached_tokens(f'generate-{i}') for i in range(args.n))} "
                  "from the prefix cache)" if hasattr(engine, "num_cached_tokens") else "")
        steps = f" in {engine.num_steps} steps" if hasattr(engine, "num_steps") else ""
        print(f"[{args.n} x {len(ids)} prompt tokens{cached}, {n_out} generated{steps} | "
              f"{n_out / max(wall, 1e-9):.1f} output tok/s, {took}]", file=sys.stderr)
    return 0

