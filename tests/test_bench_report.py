"""bench/cpu.py's plans and headline, and bench/ladder.py's naive rung, without running any engine.

The benchmark's numbers come from subprocess workers; what decides which runs are made
and which figure the headline quotes is plain Python, checked here on made-up results.
"""
import numpy as np
import pytest

from bench import cpu as bench_cpu


def _cell(decode: float, p128: float, p512: float, ttft37: float = 0.5) -> dict:
    return {"prefill": {"32": [p128 / 2], "128": [p128], "512": [p512]}, "decode": [decode], "decode_bw": [30.0],
            "ttft": {"37": [ttft37], "300": [2 * ttft37]}, "runs": 1}


def test_full_run_measures_both_policies_and_the_second_one_smaller():
    args = bench_cpu.parse_args([])
    plans = bench_cpu.table_plans(args)
    assert [p["policy"] for p in plans] == ["PASSIVE", "default"]
    assert plans[0]["threads"] == [1, 2] and plans[0]["check"] and plans[0]["transformers"] == ["fp32", "bf16"]
    assert plans[1]["threads"] == [2] and not plans[1]["check"] and plans[1]["transformers"] == ["bf16"]


def test_quick_run_is_passive_only_unless_asked():
    assert [p["policy"] for p in bench_cpu.table_plans(bench_cpu.parse_args(["--quick"]))] == ["PASSIVE"]
    both = bench_cpu.table_plans(bench_cpu.parse_args(["--quick", "--omp-wait-policy", "both"]))
    assert [p["policy"] for p in both] == ["PASSIVE", "default"]


def test_headline_takes_each_engine_at_its_own_best_policy():
    args = bench_cpu.parse_args(["--threads", "2", "--formats", "int8"])
    plans = bench_cpu.table_plans(args)
    passive = [bench_cpu.Row("stage1", "int8", 1, {"cells": {"2": _cell(40.0, 100.0, 200.0)}}),
               bench_cpu.Row("llama.cpp", "Q8_0", 1, {"cells": {"2": _cell(20.0, 90.0, 150.0)}})]
    default = [bench_cpu.Row("stage1", "int8", 1, {"cells": {"2": _cell(38.0, 110.0, 190.0)}}),
               bench_cpu.Row("llama.cpp", "Q8_0", 1, {"cells": {"2": _cell(32.0, 80.0, 250.0)}})]
    tables = [{"plan": plans[0], "rows": passive}, {"plan": plans[1], "rows": default}]
    best = bench_cpu.best_by_policy(args, tables)
    assert best[("stage1", "int8", 2, "decode")] == (40.0, "PASSIVE")
    assert best[("llama.cpp", "Q8_0", 2, "decode")] == (32.0, "default")
    assert best[("llama.cpp", "Q8_0", 2, 512)] == (250.0, "default")
    line = "\n".join(bench_cpu.headline(args, tables))
    assert "1.25×" in line            # decode 40 / 32: stage 1 PASSIVE against llama.cpp default
    assert "0.80×" in line            # prefill 512: 200 / 250
    assert "decode met (≥1.0×); prefill 512 met (≥0.8×)" in line


def test_avx2_profile_sets_haswell_for_stage1_and_the_lib_for_llama(tmp_path):
    (tmp_path / "libllama.so").write_bytes(b"")
    args = bench_cpu.parse_args(["--cpu-profile", "avx2", "--llama-avx2-lib", str(tmp_path)])
    env = bench_cpu.profile_env(args, "stage1")
    assert env["NUMBA_CPU_NAME"] == "haswell"
    assert "+avx2" in env["NUMBA_CPU_FEATURES"].split(",") and "avx512" not in env["NUMBA_CPU_FEATURES"]
    assert bench_cpu.profile_env(args, "llama.cpp") == {"LLAMA_CPP_LIB_PATH": str(tmp_path)}
    assert bench_cpu.profile_env(args, "transformers") == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert bench_cpu.profile_env(bench_cpu.parse_args([]), "stage1") == {}
    missing = bench_cpu.parse_args(["--cpu-profile", "avx2", "--llama-avx2-lib", str(tmp_path / "nope")])
    assert missing.llama_missing and "build_llama_avx2.sh" in missing.llama_missing


def test_moe_benchmark_hands_each_worker_the_profile_and_the_activations(tmp_path, monkeypatch):
    """bench moe --cpu-profile avx2 --activations int8: stage 1's workers get haswell and int8, llama.cpp's
    the AVX2 build; without that build llama.cpp's cell says why and no worker starts for it."""
    from bench import moe as bench_moe
    (tmp_path / "libllama.so").write_bytes(b"")
    seen = []

    def fake_worker(module, spec, timeout, log, omp_wait_policy, env_extra=None):
        seen.append((spec["engine"], spec.get("activations"), env_extra or {}))
        return {"error": "not run here"}
    monkeypatch.setattr(bench_moe, "run_worker", fake_worker)
    monkeypatch.setattr(bench_moe, "llama_cpp_installed", lambda: True)
    monkeypatch.setattr(bench_moe, "gguf_decode_bytes", lambda path, shape: 1)
    plan = {"policy": "PASSIVE", "threads": [2], "check": False}
    paths = {"hf": tmp_path, "Q8_0": tmp_path / "q8.gguf"}
    argv = ["--quick", "--engines", "stage1,llama.cpp", "--formats", "int8", "--kernels", "auto",
            "--cpu-profile", "avx2", "--activations", "int8", "--llama-avx2-lib"]
    rows, _ = bench_moe.run_table(bench_moe.parse_args(argv + [str(tmp_path)]), bench_moe.MOE_QUICK, paths,
                                  lambda s: None, plan)
    by_engine = {engine: (act, env) for engine, act, env in seen}
    assert by_engine["stage1"][0] == "int8" and by_engine["stage1"][1]["NUMBA_CPU_NAME"] == "haswell"
    assert by_engine["llama.cpp"][1] == {"LLAMA_CPP_LIB_PATH": str(tmp_path)}
    seen.clear()
    rows, _ = bench_moe.run_table(bench_moe.parse_args(argv + [str(tmp_path / "nope")]), bench_moe.MOE_QUICK, paths,
                                  lambda s: None, plan)
    assert [engine for engine, _, _ in seen] == ["stage1"]
    assert "build_llama_avx2.sh" in next(r.result["error"] for r in rows if r.engine == "llama.cpp")


def test_ladder_naive_rung_equals_the_weights_own_definition():
    from bench import ladder
    rng = np.random.default_rng(3)
    w = ladder.random_weight(70, 100, "int8", rng)          # 100 is not a multiple of the group: padded
    x = rng.standard_normal((1, 100), dtype=np.float32)
    buf = np.empty(w.out_features * w.padded_in, dtype=np.float32)
    got = ladder.dequant_then_matmul(w, x, buf)
    np.testing.assert_allclose(got, w.matmul_ref(x), rtol=1e-5, atol=1e-5)
    assert np.abs(got).max() > 0


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_ladder_matrices_have_the_model_shapes(fmt):
    from bench import ladder
    mats = ladder.model_matrices(bench_cpu.QUICK, fmt, np.random.default_rng(0))
    s = bench_cpu.QUICK
    assert len(mats) == 4 * s.num_hidden_layers + 1
    assert (mats[0].out_features, mats[0].in_features) == (
        (s.num_attention_heads + 2 * s.num_key_value_heads) * s.head_dim, s.hidden_size)
    assert mats[-1].fmt == "int8" and mats[-1].out_features == s.vocab_size
    assert {m.fmt for m in mats[:-1]} == {fmt}


def test_prefill_headline_ranks_time_to_first_token_by_the_smaller_time_and_checks_targets():
    """TTFT: the smaller time wins, the ratio is llama.cpp's time / stage 1's; the prefill targets
    of the int8 GEMM (128: >= 1.6x, 512: >= 1.5x) are read off the best-policy figures."""
    args = bench_cpu.parse_args(["--threads", "2", "--formats", "int8"])
    plans = bench_cpu.table_plans(args)
    passive = [bench_cpu.Row("stage1", "int8", 1, {"cells": {"2": _cell(40.0, 170.0, 200.0, ttft37=0.25)}}),
               bench_cpu.Row("llama.cpp", "Q8_0", 1, {"cells": {"2": _cell(20.0, 100.0, 150.0, ttft37=0.6)}})]
    default = [bench_cpu.Row("stage1", "int8", 1, {"cells": {"2": _cell(38.0, 110.0, 190.0, ttft37=0.4)}}),
               bench_cpu.Row("llama.cpp", "Q8_0", 1, {"cells": {"2": _cell(32.0, 80.0, 100.0, ttft37=0.5)}})]
    tables = [{"plan": plans[0], "rows": passive}, {"plan": plans[1], "rows": default}]
    text = "\n".join(bench_cpu.prefill_headline(args, tables))
    rows = {line.split("|")[3].strip(): line for line in text.splitlines() if line.startswith("| int8")}
    assert "250 ms (PASSIVE)" in rows["time to first token, 37-token prompt"]
    assert "500 ms (default)" in rows["time to first token, 37-token prompt"]
    assert "2.00×" in rows["time to first token, 37-token prompt"]        # 0.5 s / 0.25 s
    assert "1.70×" in rows["prefill 128"] and "met (≥1.6×)" in rows["prefill 128"]
    assert "1.33×" in rows["prefill 512"] and "NOT met (≥1.5×)" in rows["prefill 512"]
    assert "1.25×" in rows["decode"] and "met (≥1.0×)" in rows["decode"]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_prefill_gemm_layout_built_once_gives_the_gemms_bits(fmt):
    """bench.prefill_gemm's "built once" column: the whole matrix repacked beforehand, then the GEMM's own
    tiles. Its figure means something only if the arithmetic is the GEMM's: the same bits, here with a tail
    block (100 rows: 12.5 vectors of 8) and a token count that is not a multiple of the tile's. A block
    offset, a scale lane or a tail row off by one changes outputs."""
    from stage1_cpu.fast import cpu
    if not cpu.INT8:
        pytest.skip("no int8 dot product on this target: the integer GEMM is not compiled here")
    from bench.prefill_gemm import BuiltOnce
    from stage1_cpu.fast.weight import fast_quantize
    rng = np.random.default_rng(3)
    w = fast_quantize(rng.standard_normal((100, 256), dtype=np.float32) * 0.02, fmt, 32, prefill_act="int16")
    x = rng.standard_normal((37, 256), dtype=np.float32)
    got, want = BuiltOnce(w, "int16").matmul(x), w.matmul(x)
    assert got.shape == want.shape == (37, 100) and np.abs(want).max() > 0.1
    assert np.array_equal(got, want)
