"""`python -m bench profile`: every op of a prefill is timed once, on the plain path and on the
fast one (whose matmuls are FastWeight's and whose attention is fast/attention.py's, not the
module functions of stage1_cpu/kernels.py that the plain path calls)."""
from __future__ import annotations

import re

import pytest

from models import make_model


@pytest.mark.parametrize("kernels", ["plain", "fast"])
def test_profile_times_every_op_of_a_prefill_once(kernels, capsys):
    from bench import profile
    folder = make_model("qwen3")          # 2 layers, 4 / 2 heads of 32, hidden 96, MLP 160, vocab 512
    profile.main(["--model", str(folder), "--quant", "int8", "--kernels", kernels, "--tokens", "32",
                  "--steps", "2"])
    out = capsys.readouterr().out
    total = float(re.search(r"one forward pass of 32 tokens: ([\d.]+) ms", out).group(1))
    rows = {m.group(1).strip(): (float(m.group(2)), int(m.group(3)))
            for m in re.finditer(r"^  (\S.*?)\s+([\d.]+) ms\s+(\d+) calls", out, re.M)}
    calls = {label: n for label, (_, n) in rows.items()}
    # per forward pass: per layer qkv, o, gate_up, down, then the lm_head (one position);
    # RMSNorm before attention, on q, on k, before the MLP, and the final one
    assert calls == {"matmul [256, 96]": 2, "matmul [96, 128]": 2, "matmul [320, 96]": 2, "matmul [96, 160]": 2,
                     "matmul [512, 96]": 1, "attention": 2, "rmsnorm": 9, "rope": 4, "silu_mul": 2}, out
    # each call counted once (a FastWeight's fallback to Weight.matmul is inside the timed call)
    python = float(re.search(r"^  python\s+(-?[\d.]+) ms", out, re.M).group(1))
    assert python >= 0 and abs(sum(ms for ms, _ in rows.values()) + python - total) < 0.05, out
