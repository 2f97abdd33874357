"""python -m bench figures [--results DIR] [--out DIR]: the figures of docs/, drawn from saved
results.

Each figure is drawn from the JSON a benchmark command writes (no benchmark runs here), so a
figure is redrawn in seconds after the benchmark that feeds it:

  stage3_lessons.svg   docs/figures/lessons.json         python -m bench lessons --save ...
  stage1_ladder.svg    docs/figures/stage1_ladder.json   python -m bench ladder --save ...
  stage1_roofline.svg  docs/figures/stage1_roofline.json python -m bench cpu --save ...
  stage1_prefill_tile.svg docs/figures/stage1_prefill_profile.json
                       python -m bench profile --peaks --save ..., then
                       python -m bench profile --quant Q --tokens T --save ... per format and length

Every figure's caption (its last line of text) names the command that wrote its data.
Needs matplotlib (the `test` extra).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import decode_speed

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams["svg.hashsalt"] = "qwen3-stages"          # the same data gives the same file
    plt.rcParams["svg.fonttype"] = "none"                   # text stays text (searchable, small)
    return plt


def _finish(fig, data: dict, out: Path, bottom: float = 0.04) -> Path:
    """Caption the figure with the command and date of its data, save it to out, close it."""
    fig.text(0.01, 0.01, f"data: {data.get('command', '?')} ({data.get('date', '?')})", fontsize=7,
             color="0.35")
    fig.tight_layout(rect=(0, bottom, 1, 1))
    fig.savefig(out, metadata={"Date": None})
    _plt().close(fig)
    return out


def stage3_lessons(data: dict, out: Path) -> Path:
    plt = _plt()
    rows = data["rows"]
    names = [f"{r['rung']}: {r['name'].split('-', 1)[1]}" for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 2.2 + 0.25 * len(rows)))
    y = list(range(len(rows)))
    left = [0] * len(rows)
    for kind, color in (("launches", "#4c72b0"), ("blas", "#dd8452"), ("allocations", "#8172b3"),
                        ("elementwise", "#937860"), ("copies", "#da8bc3")):
        counts = [r["host_calls"][kind] for r in rows]
        a.barh(y, counts, left=left, label=kind, color=color)
        left = [x + c for x, c in zip(left, counts)]
    for i, r in enumerate(rows):
        a.text(left[i], i, f" {r['host_us'] / 1e3:.2f} ms"
               + (f" ({r['graph_host_us']:.0f} µs graph)" if r.get("graph_host_us") else ""),
               va="center", fontsize=7)
    a.set_yticks(y, names)
    a.invert_yaxis()
    a.set_xlim(0, max(left) * 1.45)
    a.set_xlabel("host calls per decode step (predicted host time)")
    a.set_title("host calls per decode step")
    a.legend(fontsize=7)
    left = [0.0] * len(rows)
    parts = (("weight_bytes_per_token", "weights", "#55a868"),
             ("kv_bytes_per_token", "KV", "#c44e52"),
             ("activation_bytes_per_token", "activations written", "#8c8c8c"))
    for key, label, color in parts:
        mb = [r.get(key, 0) / 1e6 for r in rows]
        b.barh(y, mb, left=left, label=label, color=color)
        left = [x + m for x, m in zip(left, mb)]
    b.set_yticks(y, [""] * len(rows))
    b.invert_yaxis()
    b.set_xlabel("MB read (weights, KV) and written (activations) per decode token")
    b.set_title("bytes per decode token")
    b.legend(fontsize=8)
    w = data.get("workload", {})
    fig.suptitle("Stage 2 → 3, one lesson per rung (counted on a CPU; "
                 f"{w.get('num_hidden_layers', '?')} layers, "
                 f"{w.get('num_attention_heads', '?')}/{w.get('num_key_value_heads', '?')} heads × "
                 f"{w.get('head_dim', '?')})",
                 fontsize=10)
    return _finish(fig, data, out)


def stage1_ladder(data: dict, out: Path) -> Path:
    plt = _plt()
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    y = range(len(rows))
    ms = [r["ms_per_token"] for r in rows]
    ax.barh(y, ms, color="#4c72b0")
    for i, r in enumerate(rows):
        ax.text(ms[i], i, f" {ms[i]:.1f} ms ({r['weights']}, {r['threads']} thr)", va="center",
                fontsize=8)
    ax.set_yticks(list(y), [f"{r['rung']}: {r['what']}" for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per token (decode matmuls of one token)")
    ax.set_xlim(0, max(ms) * 1.45)
    ax.set_title("Stage 1 ablation ladder", fontsize=10)
    return _finish(fig, data, out, bottom=0.05)


def stage1_roofline(data: dict, out: Path) -> Path:
    plt = _plt()
    engines = {"stage1": ("o", "#4c72b0"), "llama.cpp": ("s", "#dd8452")}
    # only they set the axes (not "read only" rows)
    rows = [r for r in data["rows"] if r["engine"] in engines]
    bw = data["bandwidth_gb_s"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    mbs = [r["mb_per_token"] for r in rows]
    xs = [min(mbs) * 0.8, max(mbs) * 1.2]
    ax.plot(xs, [bw * 1e3 / x for x in xs], "k--", lw=1,
            label=f"roofline: {bw:.1f} GB/s ÷ bytes per token")
    for engine, (marker, color) in engines.items():
        pts = [r for r in rows if r["engine"] == engine]
        ax.scatter([r["mb_per_token"] for r in pts], [r["decode_tok_s"] for r in pts],
                   marker=marker, color=color,
                   label=engine, zorder=3)
        for r in pts:
            ax.annotate(r["format"], (r["mb_per_token"], r["decode_tok_s"]),
                        textcoords="offset points",
                        xytext=(5, 4), fontsize=8)
    from matplotlib.ticker import NullFormatter, ScalarFormatter
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):                      # plain numbers on the log axes
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.set_xticks(_nice_ticks(*ax.get_xlim()))
    ax.set_yticks(_nice_ticks(*ax.get_ylim()))
    ax.set_xlabel("MB of weights read per decode token")
    ax.set_ylabel("decode tok/s")
    ax.set_title("Stage 1 decode against the memory roofline", fontsize=10)
    ax.legend(fontsize=8)
    return _finish(fig, data, out)


def stage1_prefill_tile(data: dict, out: Path) -> Path:
    """Left: the int8 GEMM's register tile (fast/gemm.py) on the repacked layout; right: the G MAC/s
    of a prefill's GEMMs (bench profile) against the measured peaks of the instructions they
    issue."""
    plt = _plt()
    from matplotlib.patches import Patch, Rectangle
    rows8, toks = data["tile"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [1.1, 1]})
    nv = rows8 // 8
    # the broadcasts: 2 int16 of one token, all lanes
    for t in range(toks):
        a.add_patch(Rectangle((2 + t * 1.6, nv * 2.2 + 0.3), 1.4, 0.8, color="#dd8452"))
        a.text(2.7 + t * 1.6, nv * 2.2 + 0.7, f"x[t{t}]\n2 values", ha="center", va="center",
               fontsize=7)
    for v in range(nv):
        y = (nv - 1 - v) * 2.2
        a.add_patch(Rectangle((0, y), 1.6, 2.0, color="#55a868"))
        a.text(0.8, y + 1.0, f"rows {8 * v}..{8 * v + 7}\n2 values each\n(16 B)", ha="center",
               va="center",
               fontsize=7)
        for t in range(toks):
            a.add_patch(Rectangle((2 + t * 1.6, y), 1.4, 2.0, fill=False, lw=1.2))
            for lane in range(8):
                a.add_patch(Rectangle((2.1 + t * 1.6, y + 0.1 + lane * 0.225), 1.2, 0.19,
                                      color="#4c72b0",
                                      alpha=0.25 + 0.06 * lane))
    a.text(2 + toks * 0.8, -0.6,
           f"{nv * toks} int32 accumulators, lane i = row i: each vpmaddwd multiplies "
           "8 rows by one token", ha="center", fontsize=7)
    a.set_xlim(-0.3, 2.2 + toks * 1.6)
    a.set_ylim(-1.0, nv * 2.2 + 1.4)
    a.axis("off")
    a.set_title(f"int8 register tile: {rows8} rows × {toks} tokens per step of k", fontsize=9)
    labels, got, peak = [], [], []
    # bench profile --save's passes
    for p in sorted(data["passes"], key=lambda p: (p["quant"], p["tokens"])):
        # its GEMMs, each against its peak
        gemms = [r for r in p["rows"] if r.get("of_peak")]
        labels.append(f"{p['quant']} integer GEMM T={p['tokens']}")
        got.append(sum(r["gmac_s"] for r in gemms) / len(gemms))
        peak.append(sum(r["gmac_s"] / r["of_peak"] for r in gemms) / len(gemms))
    y = range(len(labels))
    b.barh(y, peak, color="0.85")
    b.barh(y, got, color="#4c72b0")
    for i in y:
        b.text(got[i], i, f" {got[i]:.0f} ({100 * got[i] / peak[i]:.0f} %)", va="center",
               fontsize=7)
    b.set_yticks(list(y), labels, fontsize=7)
    b.invert_yaxis()
    b.set_xlabel(f"G multiply-adds / s, {data['passes'][0]['threads']} threads")
    b.set_title("one forward pass's GEMMs (Qwen3-0.6B), their mean", fontsize=9)
    b.legend(handles=[Patch(color=c, label=n)
                      for c, n in (("0.85", "peak of its instruction (micro-benchmark)"),
                                                          ("#4c72b0", "integer GEMM"))],
             fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    return _finish(fig, data, out)


def _nice_ticks(lo: float, hi: float) -> list[float]:
    """1, 1.5, 2, 3, 4, 6, 8 times the powers of ten between lo and hi (a log axis's labels)."""
    import math
    out = []
    for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1):
        out += [m * 10.0 ** e for m in (1, 1.5, 2, 3, 4, 6, 8) if lo <= m * 10.0 ** e <= hi]
    return out


def stage1_speculative(data: dict, out: Path) -> Path:
    """Left: speed-up over the engine's own plain decoding against drafts accepted, a point per
    prompt; right (where measured): stage 1's forward of T tokens against one, per model (the verify
    step's cost)."""
    curves = data.get("verify_ms", {})
    fig, axes = _plt().subplots(1, 2 if curves else 1, figsize=(10 if curves else 6.5, 4),
                                squeeze=False)
    ax, rows = axes[0][0], [r for r in data["rows"] if "seconds" in r]
    speed = {(r["engine"], r["mode"], r["task"], r["prompt"]): decode_speed(r) for r in rows}
    for r in [r for r in rows if r["drafted"]]:
        up = (speed[(r["engine"], r["mode"], r["task"], r["prompt"])]
              / speed[(r["engine"], "plain", r["task"], r["prompt"])])
        ax.scatter(r["accepted"] / r["drafted"], up, marker="o" if r["engine"] == "stage1" else "s",
                   label=f"{r['engine']} {r['mode']}",
                   color={"code rewrite": "#4c72b0", "quote": "#dd8452"}.get(r["task"], "#55a868"))
    # one entry per engine and mode
    legend = dict(zip(*ax.get_legend_handles_labels()[::-1]))
    ax.legend(list(legend.values()), list(legend), fontsize=7,
              title="blue code, orange quote, green chat", title_fontsize=7)
    ax.axhline(1, color="0.6", lw=0.8)
    ax.set(xlabel="drafts accepted", ylabel="decode tok/s / plain decoding's")
    if curves:
        ax = axes[0][1]
        for name, c in curves.items():
            ax.plot(range(1, 9), [c[str(T)] / c["1"] for T in range(1, 9)], marker="o", label=name)
        ax.plot(range(1, 9), range(1, 9), color="0.7", lw=0.8, ls="--",
                label="T steps of one token")
        ax.legend(fontsize=7)
        ax.set(xlabel="tokens in the step (the last one and T - 1 drafts)",
               ylabel="time / one decode step")
    return _finish(fig, data, out, bottom=0.05)


DRAW = {"stage3_lessons": ("lessons.json", stage3_lessons),
        "stage1_ladder": ("stage1_ladder.json", stage1_ladder),
        "stage1_roofline": ("stage1_roofline.json", stage1_roofline),
        "stage1_prefill_tile": ("stage1_prefill_profile.json", stage1_prefill_tile)}


def draw_all(results: Path = FIGURES, out: Path = FIGURES, fmt: str = "svg") -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    done = []
    for name, (src, fn) in DRAW.items():
        path = results / src
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: run the command in "
                                    "bench/figures.py's docstring")
        data = json.loads(path.read_text())
        if name == "stage1_prefill_tile":                        # one file, written by two commands
            data = dict(data, date=max(p["date"] for p in data["passes"]),
                        command="python -m bench profile --peaks, then --quant Q "
                                "--tokens T (--save " + src + ")")
        done.append(fn(data, out / f"{name}.{fmt}"))
    if (results / "stage1_speculative.json").is_file():      # once a quiet machine has measured it
        done.append(stage1_speculative(
            json.loads((results / "stage1_speculative.json").read_text()),
                                       out / f"stage1_speculative.{fmt}"))
    return done


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench figures",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=FIGURES, help="the JSON (default %(default)s)")
    ap.add_argument("--out", type=Path, default=FIGURES, help="the figures (default %(default)s)")
    ap.add_argument("--format", choices=["svg", "png"], default="svg", help="(default svg)")
    args = ap.parse_args()
    try:
        for p in draw_all(args.results, args.out, args.format):
            print(p)
    except (FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
