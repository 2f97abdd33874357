"""python -m bench cpu --speculative: stage 1's speculative decoding against llama.cpp's prompt
lookup on bench/speculative_tasks.json (code rewrite, quoting, free chat): greedy, the same token
ids, the best run per policy. Each request ends as a user's does, at the model's end of turn (or
--decode-tokens), and its speed is the decode's: the tokens after the first over the time after
the first, which is what drafting changes (the prefill before it is the same work either way)."""
from __future__ import annotations

import json
import sys
import time
from itertools import islice
from pathlib import Path

import numpy as np

from bench.common import (as_users_run, check_load, decode_speed, emit_result, run_worker,
                          save_json, versions)
from common.config import gguf_path
from common.engine import Request
from common.sampling import SamplingParams
from stage1_cpu.draft import PromptLookup, SpeculationStats


def stage1_run(engine, ids: list[int], n: int) -> dict:
    # no prefix reuse between runs: end to end each time
    engine.reset()
    engine.add_request(Request("bench", list(ids), SamplingParams(temperature=0.0, max_tokens=n)))
    t0, out, first = time.perf_counter(), [], None
    while engine.has_work():
        out += [e.token_id for e in engine.step() if e.token_id >= 0]
        if first is None and out:                       # the prefill's step made the first
            first = time.perf_counter()
    seconds = time.perf_counter() - t0
    # plain: a forward per token
    s = getattr(engine, "last_speculation", None) or SpeculationStats(steps=len(out) - 1)
    verify_ms = ({T: round(c * 1e3, 2) for T, c in sorted(engine.length.cost.items())}
                 if hasattr(engine, "length") else {})
    return dict(seconds=seconds, decode_seconds=t0 + seconds - first, tokens=out,
                steps=s.steps + 1, drafted=s.drafted, accepted=s.accepted,
                # the drafter's estimate of a forward of T tokens (why it drafts k)
                verify_ms=verify_ms)


def lookup_steps(prompt: list[int], out: list[int], k: int) -> int:
    """The steps prompt lookup would take to make plain decoding's text `out` (its first token
    aside) drafting k tokens a step, each step keeping the drafts up to the first that differs,
    and one token more: tokens over these steps is the ceiling of drafting on this text."""
    lookup, pos, steps = PromptLookup(), 1, 0
    while pos < len(out):
        drafts, kept = lookup.propose(prompt + out[:pos], k), 0
        while kept < len(drafts) and pos + kept < len(out) and drafts[kept] == out[pos + kept]:
            kept += 1
        pos, steps = pos + kept + 1, steps + 1
    return steps


def make_engine(spec: dict):
    """-> run(ids, n) -> {seconds, decode_seconds (after the first token), tokens, steps (forward
    passes), drafted, accepted} for one engine and mode."""
    if spec["engine"] == "stage1":
        from stage1_cpu.engine import LLMEngine
        from stage1_cpu.speculative import DraftModel, SpeculativeEngine
        kw = lambda p: dict(quant="stored" if gguf_path(Path(p)) else "int8", max_ctx=2048,  # noqa: E731
                            threads=spec["threads"], progress=False)
        draft = DraftModel(spec["draft"], **kw(spec["draft"])) if spec["mode"] == "draft" else None
        engine = (LLMEngine(spec["model"], **kw(spec["model"])) if spec["mode"] == "plain" else
                  SpeculativeEngine(spec["model"], draft=draft, draft_tokens=spec["draft_tokens"],
                                    **kw(spec["model"])))
        return lambda ids, n: stage1_run(engine, ids, n)
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    counts, lookup = {}, None
    if spec["mode"] == "lookup":                                # its drafts counted
        propose = LlamaPromptLookupDecoding(num_pred_tokens=spec["llama_draft_tokens"])

        def lookup(ids, *a, **k):
            d = propose(ids, *a, **k)
            counts.update(drafted=counts["drafted"] + len(d))
            return d
    llm = llama_cpp.Llama(model_path=str(gguf_path(Path(spec["model"]))), n_ctx=2048,
                          n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], draft_model=lookup, verbose=False)
    # counted: one forward pass, prefill included
    evaluate = llm.eval
    llm.eval = lambda tokens: (counts.update(steps=counts["steps"] + 1), evaluate(tokens))[1]

    def run(ids, n):
        llm.reset(), counts.update(steps=0, drafted=0)
        t0, out, first = time.perf_counter(), [], None
        # stops at n, or after the end of turn (kept, as stage 1's event keeps it)
        for t in islice(llm.generate(list(ids), top_k=1, temp=0.0, reset=True), n):
            out.append(int(t))
            first = first or time.perf_counter()        # after the prefill and one sampling
            if llm.token_eos() == t:
                break
        seconds = time.perf_counter() - t0
        return dict(seconds=seconds, decode_seconds=t0 + seconds - first, tokens=out,
                    steps=counts["steps"], drafted=counts["drafted"],
                    # each forward makes its accepted drafts and one more
                    accepted=len(out) - counts["steps"])
    return run


def verify_costs(spec: dict) -> dict:
    """Stage 1's forward of T = 1..8 tokens (the last token and T - 1 drafts, all their logits)
    after a 128-token context, best of `runs` rounds, the T interleaved so that each sees the same
    machine -> {T: ms}: section 15's curve, T tokens against one."""
    from stage1_cpu.engine import LLMEngine         # here: in the worker alone
    model = LLMEngine(spec["model"], quant=spec["quant"], threads=spec["threads"], max_ctx=256,
                      progress=False).model
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 136)
    model.forward(ids[:128], 0)
    best = {}
    for _ in range(spec["runs"] + 1):                           # the first round is a warm-up
        for T in range(1, 9):
            t0 = time.perf_counter()
            model.forward(ids[128:128 + T], 128, all_logits=T > 1)
            ms = (time.perf_counter() - t0) * 1e3
            best[T] = min(best.get(T, ms), ms) if _ else float("inf")
    return best


def worker(spec: dict) -> None:
    as_users_run(spec.get("engine", "stage1"))  # a peer: its wait policy as given, not stage 1's
    if spec.get("mode") == "verify":
        return emit_result({"verify_ms": verify_costs(spec)})
    # an engine's modes in one process, their runs taking turns: a ratio of a few per cent needs
    # both sides on the same machine state (separate processes differ by up to ~10 %)
    runs, rows = {mode: make_engine(dict(spec, mode=mode)) for mode in spec["modes"]}, []
    for task, prompts in spec["prompts"].items():
        for i, ids in enumerate(prompts):
            for run in runs.values():
                run(ids, spec["max_tokens"])                    # warm-up: compiles, pages, buffers
            best = {}
            for _ in range(spec["runs"]):
                for mode, run in runs.items():
                    r = run(ids, spec["max_tokens"])
                    if mode not in best or r["decode_seconds"] < best[mode]["decode_seconds"]:
                        best[mode] = r
            rows += [dict(task=task, prompt=i, mode=mode, **r) for mode, r in best.items()]
    emit_result({"rows": rows})


def run(args, policies: list[str], shape_model: Path, log=print) -> int:
    from common.chat_template import ChatTemplate   # here: the workers need none of these
    from common.models import resolve_model
    from common.tokenizer import Tokenizer
    from stage1_cpu.speculative import DRAFT_TOKENS
    model = resolve_model(args.model)
    tok, template = Tokenizer(model), ChatTemplate.from_folder(model)
    prompts = {task: [tok.encode(template.render([{"role": "user", "content": p}])) for p in ps]
               for task, ps in json.loads(
                   Path(__file__).with_name("speculative_tasks.json").read_text()).items()}
    base = dict(model=str(model), draft=args.draft_model and str(resolve_model(args.draft_model)),
                prompts=prompts,
                threads=max(args.threads), max_tokens=args.decode_tokens, runs=args.runs,
                draft_tokens=args.draft_tokens, llama_draft_tokens=args.draft_tokens or 10)
    log(check_load("before"))
    best: dict = {}
    for policy in policies:
        for engine, modes in [("stage1", ["plain", "ngram"] + ["draft"] * bool(args.draft_model)),
                              ("llama.cpp", ["plain", "lookup"])]:
            # a missing package or model: that engine's rows say so
            res = run_worker("bench.speculative", dict(base, engine=engine, modes=modes),
                             args.worker_timeout, log, omp_wait_policy=policy)
            for r in res.get("rows", [dict(task=t, prompt=i, mode=m, error=res.get("error"))
                                      for t in prompts for i in range(len(prompts[t]))
                                      for m in modes]):
                key = (engine, r["mode"], r["task"], r["prompt"])
                slowest = {"decode_seconds": float("inf")}
                if (r.get("decode_seconds", float("inf"))
                        <= best.get(key, slowest)["decode_seconds"]):
                    best[key] = dict(r, engine=engine, policy=policy)
    # the verify step's cost by T, on both models, best policy
    curves = {}
    for name, folder, quant in [(model.name, model, "stored"),
                                ("qwen3-0.6b-shape int8", shape_model, "int8")]:
        for policy in policies:
            res = run_worker("bench.speculative",
                             dict(base, mode="verify", model=str(folder), quant=quant, runs=20),
                             args.worker_timeout, log, omp_wait_policy=policy).get("verify_ms", {})
            curves[name] = {T: min(ms, curves.get(name, {}).get(T, ms)) for T, ms in res.items()}
        log(f"{name}: a forward of T tokens / one: " +
            ", ".join(f"T={T} {ms / curves[name]['1']:.2f}" for T, ms in curves[name].items()))
    log(check_load("after"))
    rows, plain = list(best.values()), {k[2:]: r.get("tokens", []) for k, r in best.items()
                                        if k[:2] == ("stage1", "plain")}
    # the same tokens as stage 1's plain greedy decoding, up to the first difference
    for r in rows:
        ref, mine = plain.get((r["task"], r["prompt"]), []), r.pop("tokens", [])
        if (r["engine"], r["mode"]) == ("stage1", "plain") and mine:
            r["lookup_steps"] = lookup_steps(prompts[r["task"]][r["prompt"]], mine,
                                             args.draft_tokens or DRAFT_TOKENS)
        r["tokens"], r["same_as_plain"] = len(mine), next(
            (i for i, (a, b) in enumerate(zip(ref, mine)) if a != b), min(len(ref), len(mine)))
        log(f"{r['engine']:9} {r['mode']:6} {r['task']:12} #{r['prompt']}: " + (r.get("error") or (
            f"{decode_speed(r):6.1f} tok/s, {r['tokens'] / max(r['steps'], 1):.2f} "
            f"tokens/step ({r['policy']}), first {r['same_as_plain']} tokens as stage 1 plain")))
    if args.save:
        save_json(args.save, "python -m bench cpu " + " ".join(args.argv),
                  threads=max(args.threads), model=model.name,
                  rows=rows, verify_ms=curves,
                  peer=f"llama-cpp-python {versions().get('llama-cpp-python', 'not installed')}")
        log(f"results written to {args.save}")
    return 0


if __name__ == "__main__":
    worker(json.loads(sys.argv[sys.argv.index("--worker") + 1]))
