"""bench/gpu_stage3.py's steps run end to end on the numpy twins (BENCH_GPU_DEVICE=cpu) on a
tiny model: a smoke test of the script, so the GPU run does not find a typo. The numbers
are meaningless here; that each step finishes and fills its row is what is checked."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from models import make_model

ROOT = Path(__file__).resolve().parent.parent


def test_stage3_bench_steps_run_on_the_twins(tmp_path):
    folder = make_model("qwen3", vocab_size=10240)              # the workload's ids reach 10,000
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_GPU_DEVICE": "cpu", "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "bench.gpu_stage3", "--out", str(tmp_path), "--quick",
                        "--steps", "s3_b1,s3_attn,s3_prefix", "--model-folder", str(folder), "--deadline-s", "280"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "gpu_stage3.json").read_text())
    assert all(res[s]["status"] == "ok" for s in ("s3_b1", "s3_attn", "s3_prefix")), r.stdout
    assert res["s3_b1"]["decode_tok_s"] > 0 and res["s3_b1"]["bytes_per_token"] > 0
    assert res["s3_attn"]["tensor_cores"]["tflops"] > 0
    assert res["s3_prefix"]["on"]["hit_rate"] > 0.5 and res["s3_prefix"]["off"]["hit_rate"] == 0
    table = (tmp_path / "gpu_stage3.md").read_text()
    assert "% hit" in table and "prefill attention" in table
