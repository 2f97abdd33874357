"""python -m bench report [--check]: the results tables of README.md and docs/, written from saved
JSON.

A table sits in its document between `<!-- report: NAME -->` and `<!-- /report -->`; what is
between them is this program's. NAME: cpu (stage 1 ÷ llama.cpp per CPU class: int8, int4,
decode, prefill 128 / 512), cpu-full (every metric of each saved CPU run), ladder / prefill
(the ablation ladder's rungs), prefill-profile (bench profile --save: where a prefill's time
goes), lessons (the stage 2 -> 3 ladder, counted), lines (each `path` (N) in the block given
its line count again, to 2 digits), speculative (bench cpu --speculative, per task), busy
(bench cpu --busy). CPU runs: docs/results/cpu-*.json (`bench cpu --save`) and busy.json
(`--busy`), the rest docs/figures/*.json.
--check writes nothing, exits 1 naming each stale table.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from bench import lessons
from bench.common import markdown_table, rungs_table
from bench.cpu import LLAMA_FORMAT, at_threads, busy_table, comparison

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- report: ([\w-]+) -->\n)(.*?)(<!-- /report -->)", re.S)
NOT_MEASURED = ("Not measured on this machine yet: run `python -m bench cpu --threads 2 --formats "
                "bf16,int8,int4 --save docs/results/cpu-avx512.json` (an AVX2 CPU: "
                "cpu-avx2.json), then `python -m bench report`.\n")
# the README's columns
METRICS = {"decode": "decode", "128": "prefill 128", "512": "prefill 512"}


def cpu_runs(root: Path) -> list[dict]:
    """The saved CPU runs, each with its CPU class, AVX2 first."""
    runs = [json.loads(p.read_text())
            for p in sorted((root / "docs" / "results").glob("cpu-*.json"))]
    for run in runs:
        flags = set(run["cpu_flags"])
        extra = ", ".join(n for f, n in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"))
                          if f in flags)
        run["class"] = ("AVX2" + (" (AVX-512 host as stand-in)" if "avx512f" in flags else "")
                        if run["cpu_profile"] == "avx2" or "avx512f" not in flags
                        else f"AVX-512 ({extra or 'F'})")
        run["class"] = "no AVX2" if "avx2" not in flags else run["class"]
    return sorted(runs, key=lambda r: ("AVX-512" in r["class"], r["class"]))


def caption(run: dict) -> str:
    busy = (f"; **busy**: other processes used {run['others_cores']:.2f} cores"
            if run["others_cores"] > 0.25 else "")
    shape = (f"; the {run['shape']} shape, not Qwen3-0.6B's"
             if run["shape"] != "qwen3-0.6b-shape" else "")
    return (f"- {run['class']}: {run['machine']}; {(n := max(run['threads']))} "
            f"thread{'s' * (n > 1)}; {run['date']}; llama-cpp-python "
            f"{run['versions'].get('llama-cpp-python', 'not installed')}{shape}{busy}; "
            f"`{run['command']}`")


def cpu_table(root: Path) -> str:
    """Stage 1 ÷ llama.cpp per CPU class, int8 and int4, at each run's largest thread count."""
    runs, rows = cpu_runs(root), []
    for run in runs:
        got = at_threads(run["best"], max(run["threads"]))
        for fmt, q in ((f, LLAMA_FORMAT[f]) for f in ("int8", "int4")):
            pairs = [(got.get(("stage1", fmt, m)), got.get(("llama.cpp", q, m))) for m in METRICS]
            if any(s for s, _ in pairs):
                rows.append([run["class"], f"{fmt} ÷ {q}",
                             *(f"**{s[0] / ll[0]:.2f}×** ({s[0]:.1f} / {ll[0]:.1f} tok/s)"
                               if s and ll else "–" for s, ll in pairs)])
    return (markdown_table(["CPU", "stage 1 ÷ llama.cpp", *METRICS.values()], rows) + "\n\n"
            + "\n".join(map(caption, runs)) + "\n") if rows else NOT_MEASURED


def cpu_full(root: Path) -> str:
    out = [line for run in cpu_runs(root)
           for line in (caption(run), "", comparison(at_threads(run["best"], max(run["threads"]))),
                        "")]
    return "\n".join(out) if out else cpu_table(root)


def busy(root: Path) -> str:
    """bench cpu --busy's saved run (docs/results/busy.json): its table, then the machine, the
    command and the cores the busy processes and other programs used beside each load."""
    path = root / "docs" / "results" / "busy.json"
    if not path.is_file():
        return ("Not measured yet: `python -m bench cpu --busy 2 --formats int8 --prompt-lens 128 "
                "--ttft-lens '' --save docs/results/busy.json`, then `python -m bench report`.\n")
    d = json.loads(path.read_text())
    cores = "; ".join(f"{x['busy']}: they {x['busy_cores']:.2f}, others {x['others_cores']:.2f}"
                      for x in d["loads"])
    llama = d["versions"].get("llama-cpp-python", "not installed")
    return (busy_table(d) + f"\n\n- {d['machine']}; {d['date']}; llama-cpp-python {llama}; cores "
            f"used beside each number of busy processes, {cores}; `{d['command']}`\n")


def ladder(root: Path, key: str = "rows") -> str:
    """The ablation ladder's decode rungs or (key "prefill") its prefill rungs, each against the
    first."""
    d = json.loads((root / "docs" / "figures" / "stage1_ladder.json").read_text())
    r, ms = d.get(key) or [], "ms_per_token" if key == "rows" else "ms_per_prompt_token"
    if not r:
        return (f"The saved ladder has no {key} rungs yet: "
                "`python -m bench ladder --save docs/figures/stage1_ladder.json`.\n")
    return rungs_table(r, ms) + f"\n\n- {d['machine']}; {d['date']}; `{d['command']}`\n"


def counted(root: Path) -> str:
    d = json.loads((root / "docs" / "figures" / "lessons.json").read_text())
    return lessons.table(d["rows"], lessons.DOCS_COLUMNS) + f"\n\n- `{d['command']}`, {d['date']}\n"


def lines(root: Path, body: str) -> str:
    """The block with every `path` (N) (a file or a glob) given its line count again."""
    def count(m: re.Match) -> str:
        n = sum(len(p.read_text().splitlines()) for p in root.glob(m.group(1)) if p.is_file())
        if not n:
            raise FileNotFoundError(f"{m.group(1)} names no file of the repository")
        # 2 digits: an edit seldom moves it
        return f"`{m.group(1)}` ({round(n, 2 - len(str(n))):,})"
    body = re.sub(r"`([\w./*-]+)` \(([\d,]+)\)", count, body)
    columns = {"exercises": "course.exercises map-column", "tests": "course.chapter_tests"}
    for column, command in columns.items():
        if f"| {column} |" in body:                  # the course map's: the course writes them
            body = subprocess.run([sys.executable, "-m", *command.split()], input=body, cwd=root,
                                  capture_output=True, text=True, check=True).stdout
    return body


# bench serve's tables (docs/server.md): NAME -> its JSON in docs/figures, the command that saves it
SERVE = {"serve-compare": ("serve_compare.json", "python -m bench serve"),
         "serve-soak": ("serve_soak.json", "python -m bench serve --soak"),
         "serve-drills": ("serve_drills.json",
                          "QS_DRILLS=20 python -m pytest tests/test_serve_faults.py -k drills")}


def cell(x) -> str:
    if isinstance(x, dict):                 # errors by kind
        return ", ".join(f"{k}: {n}" for k, n in x.items()) or "0"
    return "–" if x is None else {True: "yes", False: "NO"}[x] if isinstance(x, bool) else \
        f"{x:,.{2 if abs(x) < 10 else 1 if abs(x) < 100 else 0}f}" if isinstance(x, float) \
        else str(x)


def serve_table(res: dict) -> str:
    """A bench serve result's rows (their keys the columns), its note, the machine, the load, the
    date, the command."""
    rows, cols = res["rows"], [k for k, v in res["rows"][0].items() if not isinstance(v, list)]
    return markdown_table(cols, [[cell(r.get(k)) for k in cols] for r in rows]) + "".join(
        f"\n\n{res[k]}" for k in ("note",) if k in res) + (
        f"\n\n{res['machine']}; 1-minute load {res['load_1min']:.1f} before; {res['date']}; "
        f"`{res['command']}`")


def serve(root: Path, name: str) -> str:
    src, cmd = SERVE[name]
    path = root / "docs" / "figures" / src
    return serve_table(json.loads(path.read_text())) + "\n" if path.is_file() else \
        f"Not measured yet: `{cmd}` saves docs/figures/{src}, then `python -m bench report`.\n"


def speculative(root: Path) -> str:
    """bench cpu --speculative's rows: each engine and drafting mode per task (its prompts
    together), its output tok/s, its speed-up over the same engine's plain decoding, tokens per
    forward pass, drafts accepted."""
    path = root / "docs" / "figures" / "stage1_speculative.json"
    if not path.is_file():
        return ("Not measured yet: `python -m bench cpu --speculative --save "
                "docs/figures/stage1_speculative.json`, then `python -m bench figures` and "
                "`python -m bench report`.\n")
    data, total = json.loads(path.read_text()), {}
    # a task's prompts summed: the tokens after each first over the seconds after it
    for r in (r for r in data["rows"] if "seconds" in r):
        t = total.setdefault((r["task"], r["engine"], r["mode"]), dict.fromkeys(
            ("tokens", "decode_seconds", "steps", "drafted", "accepted", "lookup_steps"), 0))
        for k in t:
            t[k] += r.get(k, 0)
        t["decoded"] = t.get("decoded", 0) + r["tokens"] - 1
    speed = {k: t["decoded"] / t["decode_seconds"] for k, t in total.items()}
    body = [[e, m, task, f"{speed[k]:.1f}",
             f"{speed[k] / speed[(task, e, 'plain')]:.2f}x" if (task, e, "plain") in speed
             else "–", f"{t['tokens'] / max(t['steps'], 1):.2f}",
             f"{t['accepted'] / t['drafted']:.0%}" if t["drafted"] else "–",
             f"{t['decoded'] / t['lookup_steps']:.2f}" if t["lookup_steps"] else "–"]
            for k, t in sorted(total.items()) for task, e, m in [k]]
    head = ["engine", "drafts", "task", "decode tok/s", "speed-up", "tokens/step",
            "drafts accepted", "lookup's reach"]
    curves = data.get("verify_ms", {})         # stage 1's forward of T tokens, per model
    verify = "\n\n" + markdown_table(
        ["stage 1: a forward of T tokens ÷ one"] + [f"T = {T}" for T in range(1, 9)],
        [[name]
         + [f"{c[str(T)] / c['1']:.2f}" + (f" ({c['1']:.1f} ms)" if T == 1 else "")
            for T in range(1, 9)]
         for name, c in curves.items()]) if curves else ""
    return ("![Speculative decoding](figures/stage1_speculative.svg)\n\n"
            + markdown_table(head, body) + verify +
            f"\n\n{data['model']}, {data['threads']} threads, {data['peer']}; {data['machine']}; "
            f"{data['date']}\n")


def prefill_profile(root: Path) -> str:
    """bench profile --save's passes: where a prefill's time goes (GEMM, rounding, attention, the
    rest) and each GEMM's multiply-adds per second against the peak of the instruction its tile
    issues."""
    path = root / "docs" / "figures" / "stage1_prefill_profile.json"
    d, body = json.loads(path.read_text()) if path.is_file() else {"passes": []}, []
    if not d["passes"]:
        return "Not measured yet: `python -m bench profile --quant int8 --tokens 512 --save " \
               "docs/figures/stage1_prefill_profile.json` (and int4, 128), " \
               "then `python -m bench report`.\n"
    for p in sorted(d["passes"], key=lambda p: (p["quant"], p["tokens"])):

        def part(*keys):
            return sum(r["ms"] for r in p["rows"] if r["what"].startswith(keys)) / p["ms"]
        gemms = [r for r in p["rows"] if "gmac_s" in r]

        def rate(r):
            return f"{r['gmac_s']:.0f}" + (f" ({r['of_peak']:.0%})" if r.get("of_peak") else "")
        body.append([p["quant"], p["tokens"], f"{p['tokens'] / p['ms'] * 1e3:.0f}",
                     f"{part('gemm'):.0%}",
                     f"{part('round'):.0%}", f"{part('attention'):.0%}", f"{part('matmul'):.0%}",
                     f"{1 - part('gemm', 'round', 'attention', 'matmul'):.0%}",
                     ", ".join(f"{r['what'].split(' ', 1)[1]}: {rate(r)}" for r in gemms)])
    head = ["weights", "T", "tok/s", "GEMM", "rounding", "attention", "matmul glue", "rest",
            "G MAC/s per GEMM [O, K] (of peak)"]
    return markdown_table(head, body) + f"\n\n- {d['machine']}; {p['threads']} threads, " \
        f"OMP_WAIT_POLICY {p['policy']}; {p['date']}; " \
        "`python -m bench profile --quant Q --tokens T --save …`\n"


TABLES = {"cpu": cpu_table, "prefill-profile": prefill_profile, "cpu-full": cpu_full,
          "ladder": ladder, "lessons": counted,
          "busy": busy, "prefill": lambda root: ladder(root, "prefill"), "speculative": speculative,
          **{name: lambda root, name=name: serve(root, name) for name in SERVE}}


def rewrite(text: str, root: Path = ROOT, changed: list | None = None) -> str:
    """`text` with every report block as report writes it; the names of those that change go to
    `changed`."""
    def block(m: re.Match) -> str:
        name = m.group(2)
        # KeyError: no such table
        body = lines(root, m.group(3)) if name == "lines" else TABLES[name](root)
        if body != m.group(3) and changed is not None:
            changed.append(name)
        return m.group(1) + body + m.group(4)
    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench report",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if a table differs from the JSON")
    ap.add_argument("--root", type=Path, default=ROOT, help="whose docs (default %(default)s)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    stale = []
    for path in [args.root / "README.md", *sorted((args.root / "docs").glob("*.md"))]:
        text, changed = path.read_text(), []
        new = rewrite(text, args.root, changed)
        stale += [f"{path.relative_to(args.root)} ({name})" for name in changed]
        if changed and not args.check:
            path.write_text(new)
    if args.check and stale:
        print("these tables differ from the saved results (bench report rewrites them): "
              f"{', '.join(stale)}", file=sys.stderr)
        return 1
    print(f"rewrote {', '.join(stale)}" if stale else "every table is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
