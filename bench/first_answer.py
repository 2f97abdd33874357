"""How often is the first answer right? The question a newcomer types first,
"What is the capital of France?", asked of the default model once per seed, under
several sampling settings:

    python -m bench first-answer [--seeds 100] [--max-tokens 24] [--settings NAME ...]

An answer is right when its first sentence says "Paris" and it is not babble
(see `judge`). The prompt is the chat's own: the model's chat template, one user
message, the tokens the stage-1 engine would get. Every answer is sampled by
common/sampling.py exactly as the engine samples it: the same Sampler, seeded
per answer, fed the logits of prompt + the tokens drawn so far, ending at an
end-of-turn id or at --max-tokens.

Cost: most seeds start the same way at a low temperature, so the logits of each
token prefix are computed once (a prefix cache in front of the model) and the
KV cache is rolled back to the longest common prefix, as the engine does between
two turns. Tokens are always fed one at a time after the prompt, as the engine's
decode does, so the logits are the engine's own, bit for bit (--check-engine
runs a few seeds through the engine itself and compares).

The whole table (12 settings, 100 seeds) took 2,800 forward passes and 22 minutes
on 2 cores shared with other jobs; a setting at a higher temperature costs more,
since its answers share fewer prefixes.
Results and the defaults chosen from them: docs/chat.md.
"""
from __future__ import annotations

import argparse
import inspect
import re
import sys
import time
from collections import Counter, OrderedDict

import numpy as np

from common.sampling import Sampler, SamplingParams

QUESTION = "What is the capital of France?"

# name -> the sampling settings measured (the model's generation_config says temperature 0.2, top-p 0.9)
SETTINGS: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "greedy rep1.1": dict(temperature=0.0, repetition_penalty=1.1),
    "greedy presence0.5": dict(temperature=0.0, presence_penalty=0.5),
    "T0.2 p0.9 (generation_config)": dict(temperature=0.2, top_p=0.9),
    "T0.2 p0.9 rep1.1": dict(temperature=0.2, top_p=0.9, repetition_penalty=1.1),
    "T0.2 p0.9 rep1.2": dict(temperature=0.2, top_p=0.9, repetition_penalty=1.2),
    "T0.2 p0.9 rep1.3": dict(temperature=0.2, top_p=0.9, repetition_penalty=1.3),
    "T0.1 p0.9": dict(temperature=0.1, top_p=0.9),
    "T0.1 p0.9 rep1.1": dict(temperature=0.1, top_p=0.9, repetition_penalty=1.1),
    "T0.2 p0.9 k20": dict(temperature=0.2, top_p=0.9, top_k=20),
    "T0.2 p0.9 min-p0.1": dict(temperature=0.2, top_p=0.9, min_p=0.1),
    "T0.2 p0.5": dict(temperature=0.2, top_p=0.5),
}


# ----------------------------------------------------------------------------- judging

def babble(text: str) -> bool:
    """Babble: a loop (a run of 1 to 4 words said again right after itself: "la femme, la
    femme, la femme"), a run of 3 words said three times, or mostly letters that are not
    ASCII (the answer went off into another script). A phrase said twice with other words
    between ("the capital of France is Paris ... the political capital of France") is not."""
    words = re.findall(r"\w+", text.lower())
    for n in range(1, 5):
        for i in range(len(words) - 2 * n + 1):
            if words[i:i + n] == words[i + n:i + 2 * n] and (n > 1 or len(words[i]) > 3):
                return True
    trigrams = Counter(zip(words, words[1:], words[2:]))
    if trigrams and max(trigrams.values()) >= 3:
        return True
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) < 0.5 * len(letters)


def judge(text: str) -> bool:
    """Right: says Paris in its first sentence, and is not babble. ("L'Étoile de la Cité
    (The City of the City) - The Capital of the City. Paris" names Paris, too late.)"""
    first_sentence = re.split(r"(?<=[.!?])\s|\n", text.strip(), maxsplit=1)[0]
    return "Paris" in first_sentence and not babble(text)


# ----------------------------------------------------------------------------- the model, with a prefix cache

class PrefixLogits:
    """logits [V] of prompt + output ids, computed by the stage-1 model one token at a
    time after the prompt (as the engine's decode feeds them), cached per prefix."""

    def __init__(self, model, prompt_ids: list[int], cache_size: int = 2000):
        self.model = model
        self.prompt = list(prompt_ids)
        self.memo: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self.cache_size = cache_size
        self.fed: list[int] = []              # output ids whose K/V follow the prompt in the KV cache
        self.forwards = 0
        t0 = time.perf_counter()
        self.memo[()] = model.forward(np.asarray(self.prompt, dtype=np.int64), 0)   # the prefill: [V]
        self.prefill_s = time.perf_counter() - t0

    def __call__(self, output_ids: list[int]) -> np.ndarray:
        key = tuple(output_ids)
        if key in self.memo:
            self.memo.move_to_end(key)
            return self.memo[key]
        # roll back to the longest common prefix with what the KV cache holds, then feed
        # the rest one token at a time (positions after it are simply overwritten)
        n = 0
        while n < min(len(self.fed), len(key)) and self.fed[n] == key[n]:
            n += 1
        self.fed = self.fed[:n]
        logits = None
        for t in key[n:]:
            logits = self.model.forward(np.asarray([t], dtype=np.int64), len(self.prompt) + len(self.fed))
            self.fed.append(t)
            self.forwards += 1
            self.memo[tuple(self.fed)] = logits
            if len(self.memo) > self.cache_size:
                self.memo.popitem(last=False)
        return logits


def answer(logits_of: PrefixLogits, params: SamplingParams, eos_ids: set[int]) -> list[int]:
    """One answer's token ids (the end-of-turn id not included), as the engine draws them."""
    sampler = Sampler(params)
    out: list[int] = []
    while len(out) < params.max_tokens:
        token = sampler(logits_of(out), logits_of.prompt, out)
        if token in eos_ids:
            break
        out.append(token)
    return out


def load(model_name: str | None, max_ctx: int = 256):
    """-> (stage-1 Model with fp32 weights, Tokenizer, prompt ids, end-of-turn ids)."""
    from pathlib import Path

    from common.chat_template import ChatTemplate
    from common.config import ModelConfig
    from common.models import resolve_model
    from common.tokenizer import Tokenizer
    from stage1_cpu.model import Model
    from stage1_cpu.weights import load_weights

    folder = Path(resolve_model(model_name))
    tok = Tokenizer(folder)
    template = ChatTemplate.from_folder(folder)
    prompt = tok.encode(template.render([{"role": "user", "content": QUESTION}],
                                        add_generation_prompt=True, enable_thinking=True))
    weights = load_weights(folder, "none", progress=False)
    # the per-op decode path: stage 1's one-region step could not be compiled on an
    # AVX2-only CPU when this was written; both paths give the same logits bit for bit
    kw = {"one_region": False} if "one_region" in inspect.signature(Model.__init__).parameters else {}
    model = Model(weights, max_ctx, **kw)
    eos = set(ModelConfig.from_folder(folder).eos_token_ids) | set(tok.eos_token_ids)
    return folder, model, tok, prompt, eos


def check_engine(folder, tok, prompt, eos, logits_of, params_list, max_tokens) -> None:
    """Run the first seeds through stage 1's LLMEngine itself: the same tokens must come out."""
    import functools

    import stage1_cpu.engine as eng
    from common.engine import Request

    if "one_region" in inspect.signature(eng.Model.__init__).parameters:
        eng.Model = functools.partial(eng.Model, one_region=False)
    engine = eng.LLMEngine(folder, max_ctx=256, progress=False)
    for i, params in enumerate(params_list):
        params = SamplingParams(**{**params.__dict__, "max_tokens": max_tokens})
        engine.add_request(Request(id=str(i), prompt_ids=prompt, params=params))
        got = []
        while engine.has_work():
            for ev in engine.step():
                if ev.token_id >= 0 and ev.token_id not in eos:
                    got.append(ev.token_id)
        want = answer(logits_of, params, eos)
        status = "same" if got == want else "DIFFERENT"
        print(f"  engine check seed {params.seed}: {status}: {tok.decode(got)!r}", flush=True)
        if got != want:
            raise SystemExit(f"engine and bench disagree: {tok.decode(want)!r}")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench first-answer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model folder or known name (default: the default model)")
    ap.add_argument("--seeds", type=int, default=100, help="answers per setting, seeds 0..N-1 (default 100)")
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per answer at most (default 24)")
    ap.add_argument("--settings", nargs="*", default=None, metavar="NAME",
                    help="which settings to run (default: all): " + "; ".join(SETTINGS))
    ap.add_argument("--show", type=int, default=3, help="wrong answers printed per setting (default 3)")
    ap.add_argument("--save", default=None, metavar="FILE.json",
                    help="write every answer, per setting, to a JSON file (to judge them again)")
    ap.add_argument("--check-engine", type=int, default=0, metavar="N",
                    help="also run the first N seeds of the first setting through the engine and compare")
    args = ap.parse_args()
    names = args.settings or list(SETTINGS)
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        ap.error(f"unknown setting(s) {unknown}; choose from {list(SETTINGS)}")

    t0 = time.perf_counter()
    folder, model, tok, prompt, eos = load(args.model)
    logits_of = PrefixLogits(model, prompt)
    print(f"{folder.name} · fp32 · stage 1 · prompt {len(prompt)} tokens · {args.seeds} seeds · "
          f"at most {args.max_tokens} tokens · loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.check_engine:
        first = SETTINGS[names[0]]
        check_engine(folder, tok, prompt, eos, logits_of,
                     [SamplingParams(seed=s, **first) for s in range(args.check_engine)], args.max_tokens)

    # the first token decides most answers: its most likely candidates, at T=1 and at T=0.2
    first = logits_of([]).astype(np.float64)
    top = np.argsort(-first)[:5]
    for T in (1.0, 0.2):
        p = np.exp((first - first.max()) / T)
        p /= p.sum()
        print(f"first token at temperature {T:g}: " + ", ".join(f"{tok.decode([int(i)])!r} {p[i]:.3f}" for i in top))

    rows, saved = [], {}
    for name in names:
        t1, f1 = time.perf_counter(), logits_of.forwards
        texts = [tok.decode(answer(logits_of, SamplingParams(seed=seed, max_tokens=args.max_tokens,
                                                             **SETTINGS[name]), eos))
                 for seed in range(args.seeds)]
        saved[name] = texts
        right = sum(judge(t) for t in texts)
        paris = sum("Paris" in t for t in texts)
        rows.append((name, right, paris, len(set(texts))))
        print(f"\n{name}: {right}/{args.seeds} right ({paris} say Paris, {len(set(texts))} distinct answers; "
              f"{logits_of.forwards - f1} forward passes, {time.perf_counter() - t1:.0f} s)", flush=True)
        common = Counter(texts).most_common(1)[0]
        print(f"  most common ({common[1]}×): {common[0]!r}")
        wrong = Counter(t for t in texts if not judge(t))
        for text, n in wrong.most_common(args.show):
            print(f"  wrong ({n}×): {text!r}")

    if args.save:
        import json
        with open(args.save, "w") as f:
            json.dump({"settings": {n: SETTINGS[n] for n in names}, "answers": saved}, f, ensure_ascii=False, indent=1)
    print(f"\n| setting | right / {args.seeds} | says Paris | distinct answers |")
    print("|---|---|---|---|")
    for name, right, paris, distinct in rows:
        print(f"| {name} | {right} | {paris} | {distinct} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
