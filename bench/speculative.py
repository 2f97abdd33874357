"""python -m bench cpu --speculative: stage 1's speculative decoding against llama.cpp's prompt
lookup (llama-cpp-python's LlamaPromptLookupDecoding), end to end, on the tasks of
bench/speculative_tasks.json: (a) a code rewrite with one change, (b) an answer quoting a passage,
(c) free chat. Greedy, the same max tokens, the chat template applied once here and the same
token ids given to both engines; each engine in its own worker, at each OpenMP wait policy, the
best run of each kept. --save writes the JSON that `python -m bench figures` draws and tables from.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench.common import check_load, emit_result, machine_description, run_worker
from common.config import gguf_path
from common.engine import Request
from common.sampling import SamplingParams

TASKS = Path(__file__).with_name("speculative_tasks.json")


def stage1_run(engine, ids: list[int], n: int) -> dict:
    engine.reset()                                   # no prefix reuse between runs: end to end each time
    if getattr(engine, "draft", None):
        engine.draft.engine.reset()
    engine.add_request(Request("bench", list(ids), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
    t0, out = time.perf_counter(), []
    while engine.has_work():
        out += [e.token_id for e in engine.step() if e.token_id >= 0]
    s = getattr(engine, "last_speculation", None)
    return dict(seconds=time.perf_counter() - t0, tokens=out, steps=s.steps + 1 if s else n,
                drafted=s.drafted if s else 0, accepted=s.accepted if s else 0)


def llama_run(llm, counts: dict, ids: list[int], n: int) -> dict:
    llm.reset()
    counts.update(steps=0, drafted=0)
    t0, out = time.perf_counter(), []
    for token in llm.generate(list(ids), top_k=1, temp=0.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return dict(seconds=time.perf_counter() - t0, tokens=out, steps=counts["steps"], drafted=counts["drafted"],
                accepted=len(out) - counts["steps"])       # each forward makes its accepted drafts and one more


def make_engine(spec: dict):
    """-> (run(ids, n) -> dict) for one engine and mode."""
    if spec["engine"] == "stage1":
        from stage1_cpu.engine import LLMEngine
        from stage1_cpu.speculative import DraftModel, SpeculativeEngine
        fmt = lambda p: "stored" if gguf_path(Path(p)) else "int8"  # noqa: E731
        kw = dict(max_ctx=2048, threads=spec["threads"], progress=False)
        if spec["mode"] == "plain":
            engine = LLMEngine(spec["model"], quant=fmt(spec["model"]), **kw)
        else:
            draft = DraftModel(spec["draft"], quant=fmt(spec["draft"]), **kw) if spec["mode"] == "draft" else None
            engine = SpeculativeEngine(spec["model"], draft=draft, draft_tokens=spec["draft_tokens"],
                                       quant=fmt(spec["model"]), **kw)
        return lambda ids, n: stage1_run(engine, ids, n)
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    counts, lookup = {}, None
    if spec["mode"] == "lookup":
        class Counted(LlamaPromptLookupDecoding):
            def __call__(self, input_ids, *a, **k):
                drafts = super().__call__(input_ids, *a, **k)
                counts["drafted"] += len(drafts)
                return drafts
        lookup = Counted(num_pred_tokens=spec["llama_draft_tokens"])
    llm = llama_cpp.Llama(model_path=str(gguf_path(Path(spec["model"]))), n_ctx=2048, n_threads=spec["threads"],
                          n_threads_batch=spec["threads"], draft_model=lookup, verbose=False)
    evaluate = llm.eval

    def counted_eval(tokens):                                   # one forward pass, prefill included
        counts["steps"] += 1
        return evaluate(tokens)
    llm.eval = counted_eval
    return lambda ids, n: llama_run(llm, counts, ids, n)


def worker(spec: dict) -> None:
    try:
        run = make_engine(spec)
        rows = []
        for task, prompts in spec["prompts"].items():
            for i, ids in enumerate(prompts):
                run(ids, spec["max_tokens"])                    # warm-up: compiles, pages, buffers
                best = min((run(ids, spec["max_tokens"]) for _ in range(spec["runs"])), key=lambda r: r["seconds"])
                rows.append(dict(task=task, prompt=i, **best))
        emit_result({"rows": rows})
    except Exception as e:                                      # a missing package or model is one row's error
        emit_result({"error": f"{type(e).__name__}: {e}"})


def run(args, policies: list[str], log=print) -> int:
    from common.chat_template import ChatTemplate
    from common.models import resolve_model
    from common.tokenizer import Tokenizer
    model = resolve_model(args.model)
    tok, template = Tokenizer(model), ChatTemplate.from_folder(model)
    prompts = {task: [tok.encode(template.render([{"role": "user", "content": p}])) for p in ps]
               for task, ps in json.loads(TASKS.read_text()).items()}
    base = dict(model=str(model), draft=args.draft_model and str(resolve_model(args.draft_model)), prompts=prompts,
                threads=max(args.threads), max_tokens=args.decode_tokens, runs=args.runs,
                draft_tokens=args.draft_tokens, llama_draft_tokens=args.draft_tokens or 10)
    modes = [("stage1", "plain"), ("stage1", "ngram")] + [("stage1", "draft")] * bool(args.draft_model) + \
        [("llama.cpp", "plain"), ("llama.cpp", "lookup")]
    log(check_load("before"))
    best: dict = {}
    for policy in policies:
        for engine, mode in modes:
            log(f"{engine} {mode} (OMP_WAIT_POLICY={policy}) ...")
            res = run_worker("bench.speculative", dict(base, engine=engine, mode=mode), args.worker_timeout, log,
                             omp_wait_policy=policy)
            for r in res.get("rows", [{"task": t, "prompt": i, "error": res.get("error")}
                                      for t in prompts for i in range(len(prompts[t]))]):
                key = (engine, mode, r["task"], r["prompt"])
                if "seconds" in r and r["seconds"] < best.get(key, {}).get("seconds", float("inf")):
                    best[key] = dict(r, engine=engine, mode=mode, policy=policy)
                best.setdefault(key, dict(r, engine=engine, mode=mode, policy=policy))
    log(check_load("after"))
    rows, plain = list(best.values()), {k[2:]: r.get("tokens", []) for k, r in best.items() if k[:2] == ("stage1", "plain")}
    for r in rows:                   # the same tokens as stage 1's plain greedy decoding, up to the first difference
        ref, mine = plain.get((r["task"], r["prompt"]), []), r.pop("tokens", [])
        r["tokens"], r["same_as_plain"] = len(mine), next((i for i, (a, b) in enumerate(zip(ref, mine)) if a != b),
                                                          min(len(ref), len(mine)))
        if "seconds" in r:
            log(f"{r['engine']:9} {r['mode']:6} {r['task']:12} #{r['prompt']}: {r['tokens'] / r['seconds']:6.1f} "
                f"tok/s, {r['tokens'] / max(r['steps'], 1):.2f} tokens/step ({r['policy']}), "
                f"first {r['same_as_plain']} tokens as stage 1 plain")
        else:
            log(f"{r['engine']:9} {r['mode']:6} {r['task']:12} #{r['prompt']}: {r.get('error')}")
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(json.dumps(dict(
            command="python -m bench cpu " + " ".join(args.argv), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            machine=machine_description(), threads=max(args.threads), model=model.name, peer=llama_version(),
            rows=rows), indent=1) + "\n")
        log(f"results written to {args.save}")
    return 0


def llama_version() -> str:
    try:
        import llama_cpp
        return f"llama-cpp-python {llama_cpp.__version__}"
    except ImportError:
        return "llama-cpp-python not installed"


if __name__ == "__main__":
    worker(json.loads(sys.argv[sys.argv.index("--worker") + 1]))
