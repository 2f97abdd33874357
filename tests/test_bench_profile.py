"""`python -m bench profile`: every op of a prefill is timed once, on the plain path and on the
fast one (whose matmuls are FastWeight's and whose attention is fast/attention.py's, not the
module functions of stage1_cpu/kernels.py that the plain path calls)."""
from __future__ import annotations

import json
import re

import pytest

from bench.testbed.models import make_model


# the fast path at 8 tokens on fp32 activations calls the plain code from inside its own: its
# attention falls back to kernels.attention below 16 queries, FastWeight.matmul to Weight.matmul
@pytest.mark.parametrize("kernels,tokens,activations", [("plain", 32, "auto"), ("fast", 32, "auto"),
                                                        ("fast", 8, "fp32")])
def test_profile_times_every_op_of_a_prefill_once(kernels, tokens, activations, capsys, tmp_path):
    from bench import profile, report
    # 2 layers, 4 / 2 heads of 32, hidden 96, MLP 160, vocab 512
    folder = make_model("qwen3")
    saved = tmp_path / "docs" / "figures" / "stage1_prefill_profile.json"
    saved.parent.mkdir(parents=True)
    from stage1_cpu import kernels as plain, quant
    from stage1_cpu.fast import gemm
    before = (gemm.gemm_tiled, gemm.round_prompt16, plain.rmsnorm, quant.Weight.matmul)
    profile.main(["--model", str(folder), "--quant", "int8", "--kernels", kernels,
                  "--activations", activations, "--tokens", str(tokens), "--steps", "2",
                  "--save", str(saved)])
    out = capsys.readouterr().out
    # the timers come off when it ends: a later test in this process sees the modules' own functions
    assert (gemm.gemm_tiled, gemm.round_prompt16, plain.rmsnorm, quant.Weight.matmul) == before
    total = float(re.search(rf"one forward pass of {tokens} tokens: ([\d.]+) ms", out).group(1))
    rows = {m.group(1).strip(): (float(m.group(2)), int(m.group(3)))
            for m in re.finditer(r"^  (\S.*?)\s+([\d.]+) ms\s+(\d+) calls", out, re.M)}
    calls = {label: n for label, (_, n) in rows.items()}
    # per forward pass: per layer qkv, o, gate_up, down, then the lm_head (one position);
    # RMSNorm before attention, on q, on k, before the MLP, and the final one
    expected = {"matmul [256, 96]": 2, "matmul [96, 128]": 2, "matmul [320, 96]": 2,
                "matmul [96, 160]": 2, "matmul [512, 96]": 1, "attention": 2, "rmsnorm": 9,
                "rope": 4, "silu_mul": 2}
    # the integer GEMM, and the rounding before it, apart
    if (kernels, activations) == ("fast", "auto"):
        expected |= {"round activations": 8, "gemm_int8 [256, 96]": 2, "gemm_int8 [96, 128]": 2,
                     "gemm_int8 [320, 96]": 2, "gemm_int8 [96, 160]": 2}
    assert calls == expected, out

    # the saved pass: the same rows; bench report's shares are those rows over the pass's time
    # (a GEMM's share counted twice, or its multiply-adds miscounted, changes the table)
    pass_ = json.loads(saved.read_text())["passes"][0]
    assert (pass_["quant"], pass_["tokens"]) == ("int8", tokens)
    assert {r["what"]: r["calls"] for r in pass_["rows"] if r["what"] != "python"} == expected
    # every op really timed, and the timed calls do not overlap: what is left for Python (the
    # forward's time less the ops') is not negative (a fallback timed again inside its caller would
    # count its time twice). The saved times, not the printed ones: on a fast CPU an op of a
    # microsecond prints as 0.00 ms
    ms = {r["what"]: r["ms"] for r in pass_["rows"]}
    assert all(ms[label] > 0 for label in expected) and 0 <= ms["python"] < pass_["ms"], out
    assert pass_["ms"] == pytest.approx(total, abs=0.005)      # the printed total, to 2 decimals
    assert sum(r["ms"] for r in pass_["rows"]) == pytest.approx(pass_["ms"])
    table = report.prefill_profile(tmp_path)
    share = sum(r["ms"] for r in pass_["rows"] if r["what"].startswith("gemm")) / pass_["ms"]
    assert f"| {tokens} " in table and f"| {share:.0%} " in table, table
    for r in pass_["rows"]:
        if "gmac_s" in r:                 # T x O x K multiply-adds per call, over its time
            O, K = map(int, re.findall(r"\d+", r["what"].split(" ", 1)[1]))
            macs = tokens * O * K * r["calls"]
            assert r["gmac_s"] == pytest.approx(macs / r["ms"] / 1e6, rel=1e-6)


def test_peaks_are_what_each_gemm_is_measured_against(tmp_path, capsys):
    """--peaks --save, then a prefill pass into the same file: the pass keeps the peaks, and each
    GEMM's "of peak" is its G MAC/s over the peak of the instruction its tile issues. The quads'
    instruction does 32 multiply-adds to the pairs' 16 (both x86 at one or two an issue cycle), so
    its peak is well above theirs: a swapped label or a wrong count of multiply-adds fails here."""
    from bench import profile
    from stage1_cpu.fast import cpu, gemm
    if cpu.INT8 not in ("avx2", "vnni"):
        pytest.skip(f"--peaks times x86's int8 dot products; this CPU's: {cpu.INT8}")
    saved = tmp_path / "profile.json"
    profile.main(["--peaks", "--threads", "1", "--save", str(saved)])
    peaks = json.loads(saved.read_text())["peaks_gmac_s"]
    pairs, quads = ("dpwssd", "dpbusd") if gemm.VNNI else ("maddwd+add", "maddubs")
    assert set(peaks) == {pairs, quads}, peaks
    assert 1 < peaks[pairs] < 1000 and peaks[quads] > 1.3 * peaks[pairs], peaks
    profile.main(["--model", str(make_model("qwen3")), "--quant", "int8", "--kernels", "fast",
                  "--tokens", "32",
                  "--steps", "2", "--threads", "1", "--save", str(saved)])
    done = json.loads(saved.read_text())
    gemms = [r for r in done["passes"][0]["rows"] if "gmac_s" in r]
    assert done["peaks_gmac_s"] == peaks and len(gemms) == 4
    # (no bound on "of peak" itself: a GEMM and the peak are timed apart, and a busy machine
    # slows one more than the other)
    assert all(r["of_peak"] == pytest.approx(r["gmac_s"] / peaks[pairs]) for r in gemms)


def test_profile_splits_the_one_region_step_by_part(capsys):
    """The step is data: bench profile runs parts of its program alone. The parts cover the program
    once (every row in one part, the matrices and attention among them), each part's line is
    printed, and the rest is the whole step less the parts (no assertion on how long a part
    takes)."""
    from bench import profile
    from stage1_cpu.engine import LLMEngine
    folder = make_model("qwen3")
    profile.main(["--model", str(folder), "--quant", "int8", "--kernels", "fast", "--tokens", "4",
                  "--steps", "2"])
    out = capsys.readouterr().out
    part = {m.group(1).strip(): float(m.group(2))
            for m in re.finditer(r"^  (\S[^\d-]*?)\s+(-?[\d.]+)$", out, re.M)}
    names = ["whole step", "layers' matrices", "lm_head", "attention", "small ops",
             "nothing (region, Python)"]
    assert all(part[n] >= 0 for n in names), part
    rest = part["whole step"] - sum(part[n] for n in names[1:])
    assert part["the rest (waits, overlap)"] == pytest.approx(rest, abs=0.03), part
    engine = LLMEngine(str(folder), quant="int8", max_ctx=64, progress=False, kernels="fast")
    prog = engine.model.decode_step.prog
    masks = profile.step_parts(prog)
    assert (sum(m.astype(int) for m in masks.values()) == 1).all()
    assert all(m.any() for m in masks.values()), {k: int(m.sum()) for k, m in masks.items()}
