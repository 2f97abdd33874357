"""The stage 2 -> stage 3 lesson series (docs/lessons/stage3/*.patch, course/series.py).

1. stage2_batched/ plus every patch, in order, equals stage3_optimized/ byte for byte; a
   patch that no longer applies, or a stage 3 that no longer matches, is reported by name.
2. Every intermediate rung (stage 2 plus the first k patches) is a working engine: built
   as a package of its own (the stages import each other's modules relatively, so a copy
   under another name imports), it runs with device="cpu" on its numpy twins and its
   greedy tokens equal transformers' on a tiny qwen3 and a tiny qwen3_moe up to the first
   near-tie, as in tests/test_stage3_engine.py (an fp32 rung against transformers on the
   model's own weights, a bf16 rung against transformers on the bf16-rounded weights).
3. The kernels a rung adds or changes run in the g++ emulator through the rung's own
   kernels.py and equal the rung's twins (one small case per kernel; the wide cases are in
   tests/test_stage3_cuda_emulated.py, on stage 3's copies of the same .cu files).
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from bench.testbed.models import BF16_MARGIN, load_hf, make_model
from common.engine import Request
from common.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("qs_lesson_series", ROOT / "course" / "series.py")
series = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(series)

FAMILIES = ["qwen3", "qwen3_moe"]
PROMPTS = {"qwen3": [5, 9, 3, 17, 22, 100, 7, 8, 40, 41, 300, 12, 250], "qwen3_moe": [1, 2, 3]}
STEPS = 6


@pytest.fixture(scope="module")
def rungs(tmp_path_factory) -> list[Path]:
    return series.unpack(tmp_path_factory.mktemp("lesson-rungs"))


@pytest.fixture(scope="module")
def packages(rungs, tmp_path_factory) -> dict[int, types.ModuleType]:
    """rung k (1 .. n-1, the intermediate ones) -> its package, imported under its own name."""
    root = tmp_path_factory.mktemp("lesson-packages")
    sys.path.insert(0, str(root))
    out = {}
    for k, rung in enumerate(rungs[1:-1], start=1):
        name = f"qs_lesson_rung{k:02d}"
        shutil.copytree(rung, root / name)
        out[k] = importlib.import_module(name)
    yield out
    sys.path.remove(str(root))


# ---- 1. the series gives stage 3 ----

def test_stage2_plus_every_patch_is_stage3_byte_for_byte():
    series.check()


def test_series_has_ten_or_more_patches_of_at_most_600_lines_each_with_a_header():
    """One idea per patch: at least ten of them, each readable in one sitting (600 lines with
    its header), and each header names its docs/stage3.md section (which exists) and says what
    it changes, what it saves and what it costs."""
    ps = series.patches()
    assert len(ps) >= 10
    headings = re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "stage3.md").read_text(), re.M)
    for k, p in enumerate(ps, start=1):
        assert len(p.read_text().splitlines()) <= 600, p.name
        head = series.header(p)
        assert head.startswith(f"Lesson {k:02d} of {len(ps)}: "), p.name
        for part in ("Changes:", "Saves", "Costs:"):
            assert f"\n{part}" in head, (p.name, part)
        section = re.search(r"docs/stage3\.md, section (\d+)\)", " ".join(head.split()))
        assert section and section.group(1) in headings, p.name


def _created_and_deleted(patch: Path) -> tuple[set[str], set[str]]:
    """The files a patch creates and the files it deletes (paths inside the rung)."""
    text = patch.read_text()
    files = lambda mode: {re.sub(r"^[ab]/", "", m) for m in re.findall(   # noqa: E731
        rf"^diff --git (\S+) \S+\n{mode} file mode", text, re.M)}
    return files("new"), files("deleted")


def test_no_patch_deletes_a_file_an_earlier_patch_created():
    created: dict[str, str] = {}
    for p in series.patches():
        new, deleted = _created_and_deleted(p)
        for path in deleted:
            assert path not in created, f"{p.name} deletes {path}, which {created[path]} created"
        created.update({path: p.name for path in new})
    assert created                                   # the parse found the files the series adds


def test_each_exercise_region_arrives_with_its_markers(rungs):
    """The rung whose lesson adds an exercise's begin/end markers also writes the code between
    them: the marked region is not already in the rung before (no lesson marks a region an
    earlier lesson wrote), and each exercise is marked once, in its own lesson."""
    found = {}
    for k, rung in enumerate(rungs[1:], start=1):
        for path in sorted(rung.rglob("*")):
            if path.suffix not in (".py", ".cu"):
                continue
            text = path.read_text()
            before = rungs[k - 1] / path.relative_to(rung)
            old = before.read_text() if before.is_file() else ""
            for ex in re.findall(r"exercise (3\.\d) begin", text):
                if f"exercise {ex} begin" in old:
                    continue
                region = text.split(f"exercise {ex} begin", 1)[1].split(f"exercise {ex} end", 1)[0]
                # the lines between the markers
                body = region.split("\n", 1)[1].rsplit("\n", 1)[0]
                assert body.strip() and body not in old, (rung.name, ex)
                assert ex not in found, (ex, found.get(ex), rung.name)
                found[ex] = rung.name
    assert set(found) == {"3.1", "3.2", "3.3", "3.4", "3.5"}, found


def test_a_changed_stage3_is_reported_with_the_last_patch(tmp_path):
    stage3 = tmp_path / "stage3_optimized"
    series.copy_tree(series.STAGE3, stage3)
    (stage3 / "ops.py").write_text((stage3 / "ops.py").read_text() + "# an edit\n")
    last = series.patches()[-1].name
    with pytest.raises(RuntimeError, match=f"ops.py.*{last}"):
        series.check(stage3=stage3)


def test_a_patch_that_no_longer_applies_is_named(tmp_path):
    copy = tmp_path / "stage3"
    shutil.copytree(series.SERIES, copy)
    second = sorted(copy.glob("*.patch"))[1]
    # a context line of its first hunk no longer matches the tree it is applied to
    text = second.read_text()
    i = text.index("\n@@ ")
    j = text.index("\n ", i + 1)                 # the first context line of that hunk
    second.write_text(text[:j + 2] + "X" + text[j + 2:])
    with pytest.raises(RuntimeError, match=second.name):
        series.check(series=copy)


def test_rebase_regenerates_the_last_patch_for_an_edited_stage3(tmp_path):
    copy, stage3 = tmp_path / "series", tmp_path / "stage3_optimized"
    shutil.copytree(series.SERIES, copy)
    series.copy_tree(series.STAGE3, stage3)
    (stage3 / "options.py").write_text((stage3 / "options.py").read_text() + "# an edit\n")
    with pytest.raises(RuntimeError):
        series.check(series=copy, stage3=stage3)
    series.rebase(series=copy, stage3=stage3)
    series.check(series=copy, stage3=stage3)
    assert series.header(sorted(copy.glob("*.patch"))[-1]) == series.header(series.patches()[-1])


def test_every_changed_cuda_file_is_one_a_rung_adds(rungs):
    """A .cu file that is neither stage 2's nor stage 3's exists only in intermediate rungs, and
    the rung that writes it lists it among its new kernels (so the emulated test below runs it)."""
    for k, rung in enumerate(rungs[1:], start=1):
        new_files = set(_new_kernels(rungs, k).values())
        for cu in (rung / "cuda").glob("*.cu"):
            before = rungs[k - 1] / "cuda" / cu.name
            if not before.is_file() or before.read_bytes() != cu.read_bytes():
                assert cu.name in new_files, (
                    f"{rung.name}/{cu.name} changed but no kernel of it is new"
                )
    for cu in (rungs[-1] / "cuda").glob("*.cu"):
        assert cu.read_bytes() == (series.STAGE3 / "cuda" / cu.name).read_bytes()


# ---- 2. every rung runs, equal to transformers ----

_oracles: dict = {}


def oracle(family: str, bf16: bool) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and top-two margins (fp32, on the bf16-rounded weights if
    bf16)."""
    key = (family, bf16)
    if key not in _oracles:
        import torch
        from stage3_optimized.ops import round_bf16
        hf = load_hf(make_model(family))
        if bf16:
            with torch.no_grad():
                for p in hf.parameters():
                    p.copy_(torch.from_numpy(round_bf16(p.numpy())))
        ids, expect, margins = list(PROMPTS[family]), [], []
        with torch.no_grad():
            for _ in range(STEPS):
                logits = hf(torch.tensor([ids])).logits[0, -1].float().numpy()
                top2 = np.sort(logits)[-2:]
                margins.append(float(top2[1] - top2[0]))
                expect.append(int(logits.argmax()))
                ids.append(expect[-1])
        _oracles[key] = expect, margins
    return _oracles[key]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_rung_gives_transformers_greedy_tokens_until_a_near_tie(packages, family):
    folder = make_model(family)
    for k, pkg in packages.items():
        engine_mod = importlib.import_module(f"{pkg.__name__}.engine")
        eng = engine_mod.LLMEngine(folder, max_ctx=64, slots=2, token_budget=32, page_size=4,
                                   num_pages=40, device="cpu", progress=False)
        bf16 = eng.weights.embed.data.dtype == np.uint16     # bf16 weights (lesson 06 on)
        expect, margins = oracle(family, bf16)
        clear = next((i for i, m in enumerate(margins) if m < BF16_MARGIN), STEPS)
        assert clear >= 4, f"{family}: a near-tie at step {clear}; choose another prompt"
        eng.add_request(Request("r", list(PROMPTS[family]),
                                SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)))
        got = []
        while eng.has_work():
            got += [ev.token_id for ev in eng.step()]
        assert eng.num_free_pages() == eng.num_total_pages(), f"rung {k}: a KV page leaked"
        assert got[:clear] == expect[:clear], (
            f"rung {k} ({pkg.__name__}), margins {np.round(margins, 3).tolist()}"
        )


def test_every_rung_names_itself_in_its_banner(packages):
    """Rung k says "stage 2 + lessons 01-k" in the chat's and server's banner and --help group;
    stage 3 says it is stage 3, stage 2 that it is stage 2."""
    import argparse
    args = argparse.Namespace(device="cpu", prefix_caching=True, cuda_graphs=True)
    for k, pkg in packages.items():
        options = importlib.import_module(f"{pkg.__name__}.options")
        want = "stage 2 + lesson 01" if k == 1 else f"stage 2 + lessons 01-{k:02d}"
        assert options.RUNG == want, (k, options.RUNG)
        assert options.describe(args).startswith(want + " · "), k
        parser = argparse.ArgumentParser()
        options.add_args(parser)
        assert want in [g.title for g in parser._action_groups], k
    stage2 = importlib.import_module("stage2_batched.options")
    stage3 = importlib.import_module("stage3_optimized.options")
    assert stage3.RUNG == "stage 3 optimized"
    assert stage3.describe(args).startswith("stage 3 optimized · ")
    assert stage2.describe(args).startswith("stage 2 batched")


def test_rung_prefix_cache_from_its_lesson_on(packages):
    """Lesson 02's effect is visible in every later rung: a shared prefix is found in the cache."""
    folder = make_model("qwen3")
    system = list(range(30, 43))                               # 13 tokens: 3 full pages of 4
    first = next(k for k, p in enumerate(series.patches(), start=1) if "prefix-cache" in p.name)
    for k, pkg in packages.items():
        if k < first:
            continue
        eng = importlib.import_module(f"{pkg.__name__}.engine").LLMEngine(
            folder, max_ctx=64, slots=2, token_budget=32, page_size=4, num_pages=40, device="cpu",
            progress=False)
        for i, tail in enumerate([[7, 8], [9]]):
            eng.add_request(
                Request(f"r{i}", system + tail, SamplingParams(temperature=0, max_tokens=2))
            )
            while eng.has_work():
                eng.step()
        assert eng.num_cached_tokens("r1") == 12, f"rung {k}"


# ---- 3. the kernels each rung adds equal its twins in the emulator ----

def _new_kernels(rungs: list[Path], k: int) -> dict[str, str]:
    """Kernel name -> .cu file, for the kernels of rung k whose source is new or changed."""
    def files(rung):
        src = (rung / "kernels.py").read_text()
        ns: dict = {}
        start = src.index("KERNEL_FILES = {")
        exec(src[start:src.index("}", start) + 1], ns)
        return ns["KERNEL_FILES"]
    before, now = files(rungs[k - 1]), files(rungs[k])
    return {n: f for n, f in now.items()
            if n not in before or (rungs[k - 1] / "cuda" / before[n]).read_bytes()
            != (rungs[k] / "cuda" / f).read_bytes()}


def _gpu(kernels, emulated, monkeypatch):
    """The rung's kernels.py on the stand-in CuPy, cuBLAS and the emulated kernels (as in
    tests/test_stage3_cuda_emulated.py's `gpu` fixture)."""
    from bench.testbed import cuda_emulator as emu
    # the emulator: 256 threads a block
    monkeypatch.setattr(kernels, "GEMV_MAX_BLOCKS", 4, raising=False)
    return emu.install(monkeypatch, kernels, emulated).dev


def _pointer_types(cu: Path, kernel: str) -> dict[str, type]:
    """The pointer parameters of `kernel` in its .cu file -> the numpy dtype it reads or writes
    (`unsigned short*`: bf16 bits): a rung's kernel takes fp32 or bf16 by its lesson."""
    text = cu.read_text()
    sig = text[text.index(f"void {kernel}("):]
    sig = sig[:sig.index("{")]
    dtypes = {"unsigned short": np.uint16, "float": np.float32, "int": np.int32}
    return {m.group(2): dtypes[m.group(1)]
            for m in re.finditer(r"(unsigned short|float|int)\s*\*\s*(?:__restrict__\s*)?(\w+)",
                                 sig)}


def _close(got, expect, min_exact=0.9):
    """bf16 bits: within two bf16 steps, mostly bit-identical; fp32: the sums' order apart."""
    from test_stage3_cuda_emulated import assert_bf16_close
    got, expect = np.asarray(got).view(np.ndarray), np.asarray(expect)
    assert got.dtype == expect.dtype and got.shape == expect.shape, (got.dtype, expect.dtype)
    if got.dtype == np.uint16:
        assert_bf16_close(got, expect, min_exact)
    else:
        assert float(np.abs(expect).max()) > 0, "an all-zero reference proves nothing"
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-5 * float(np.abs(expect).max()))


def _qk_case(K, ops, dev, arr, ptypes, rng):
    """qk_norm_rope_store through the rung's kernels.py: its LayerHeads (with or without the
    cos/sin tables) and its call (rows gathered per token, or positions into the tables)."""
    H, Hkv, D, N, NB, P = 4, 2, 32, 5, 4, 4
    qkv, qn, kn = arr("qkv", N, (H + 2 * Hkv) * D, s=2.0), arr("q_norm", D), arr("k_norm", D)
    pos = rng.integers(0, 100, N).astype(np.int32)
    cos, sin = ops.rope_tables(128, D, 1e6)
    slots = rng.permutation(NB * P)[:N].astype(np.int32)
    pool = lambda: np.zeros((NB, P, Hkv, D), ptypes["k_cache"])   # noqa: E731
    dk, dv, ek, ev = dev(pool()), dev(pool()), pool(), pool()
    fields = {f.name for f in dataclasses.fields(ops.LayerHeads)}

    def heads(k_cache, v_cache, put):                  # the rung's record: cos/sin in it or not
        kw = dict(q_norm=put(qn), k_norm=put(kn), cos=put(cos), sin=put(sin), k_cache=k_cache,
                  v_cache=v_cache, H=H, Hkv=Hkv, eps=1e-6)
        return ops.LayerHeads(**{k: v for k, v in kw.items() if k in fields})
    if "positions" in K.qk_norm_rope_store.__code__.co_varnames:   # whole tables, by position
        q = K.qk_norm_rope_store(dev(qkv), heads(dk, dv, dev), dev(pos), dev(slots))
        eq = K.qk_norm_rope_store(qkv, heads(ek, ev, np.asarray), pos, slots)
    else:                                                          # each token's own rows
        q = K.qk_norm_rope_store(dev(qkv), heads(dk, dv, dev), dev(cos[pos]), dev(sin[pos]),
                                 dev(slots))
        eq = K.qk_norm_rope_store(qkv, heads(ek, ev, np.asarray), cos[pos], sin[pos], slots)
    _close(q.get(), eq)
    _close(dk.get().reshape(-1), ek.reshape(-1), min_exact=0.5)    # most slots stay 0
    np.testing.assert_array_equal(dv.get(), ev)


def _case(name, K, ops, dev, emulated):
    """One small case of kernel `name` through the rung's kernels.py: on device arrays it runs
    the emulated kernel, on numpy arrays the rung's twin, with the dtypes the rung's .cu file
    declares (fp32 before its bf16 lesson, bf16 bits after)."""
    from test_stage2_kernels import paged
    rng = np.random.default_rng(len(name))
    cu = Path(K.__file__).parent / "cuda" / K.KERNEL_FILES[name]
    ptypes = _pointer_types(cu, name)

    def arr(param, *shape, s=1.0):
        x = (rng.standard_normal(shape) * s).astype(np.float32)
        return ops.bf16_bits(x) if ptypes[param] == np.uint16 else x

    def as_(param, x):
        return ops.bf16_bits(x) if ptypes[param] == np.uint16 else x

    if name == "embedding":
        table, ids = arr("table", 20, 33), rng.integers(0, 20, 5).astype(np.int32)
        got = K.embedding(dev(ids), dev(table)).get()
        np.testing.assert_array_equal(got, K.embedding(ids, table))
    elif name == "rmsnorm":
        x, w = arr("residual", 3, 96, s=3.0), arr("w", 96)
        _close(K.rmsnorm(dev(x), dev(w), 1e-6).get(), K.rmsnorm(x, w, 1e-6))
    elif name == "gemv":
        from test_stage3_cuda_emulated import check_gemv, check_gemv_prologues
        check_gemv(dev, 2, 264, 13, kernels=K, ops=ops)
        check_gemv_prologues(dev, kernels=K)
    elif name == "qk_norm_rope_store":
        _qk_case(K, ops, dev, arr, ptypes, rng)
    elif name == "swiglu":
        gu = arr("gate_up", 3, 96, s=2.0)
        _close(K.swiglu(dev(gu)).get(), K.swiglu(gu))
    elif name in ("paged_decode_attention", "merge_attention"):
        if name == "merge_attention":                        # the pages' dtype: the split kernel's
            ptypes = _pointer_types(cu, "paged_decode_attention")
        lens = [1, 17, 40]
        k32, v32, tables, *_ = paged(rng, lens, 2, 32, 16)
        kc, vc, q = as_("k_cache", k32), as_("v_cache", v32), arr("q", 3, 4, 32)
        ctx = np.array(lens, np.int32)
        split = "split_len" in K.paged_decode_attention.__code__.co_varnames
        kw = {"split_len": 16} if split else {}
        out = K.paged_decode_attention(dev(q), dev(kc), dev(vc), dev(tables), dev(ctx), **kw)
        _close(out.get(), K.paged_decode_attention(q, kc, vc, tables, ctx))
    elif name in ("prefill_attention", "prefill_attention_tc"):
        chunks = [(0, 17), (5, 3)]
        k32, v32, tables, *_ = paged(rng, [b + n for b, n in chunks], 2, 64, 16)
        kc, vc = as_("k_cache", k32), as_("v_cache", v32)
        token_seq = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(chunks)])
        token_seq = token_seq.astype(np.int32)
        positions = np.concatenate([np.arange(b, b + n) for b, n in chunks]).astype(np.int32)
        q = arr("q", len(positions), 4, 64)
        args = [dev(q), dev(kc), dev(vc), dev(tables), dev(token_seq), dev(positions)]
        expect = K.prefill_attention(q, kc, vc, tables, token_seq, positions)
        if name == "prefill_attention":
            plain = "tensor_cores" in K.prefill_attention.__code__.co_varnames
            kw = {"tensor_cores": False} if plain else {}
            _close(K.prefill_attention(*args, **kw).get(), expect)
        else:
            # <= 16 tokens of one sequence
            tiles = np.array([0, 16, 17], np.int32), np.array([16, 1, 3], np.int32)
            got = K.prefill_attention(*args, dev(tiles[0]), dev(tiles[1])).get()
            np.testing.assert_allclose(ops.f32(got), ops.f32(expect), rtol=2 ** -6,
                                       atol=1e-2 * float(np.abs(ops.f32(expect)).max()))
            assert float(np.mean(got == expect)) >= 0.33
    elif name == "sample":
        V = 300
        logits = (rng.standard_normal((3, V)) * 3).astype(np.float32)
        temperature, top_k = np.array([0, 1, 0.8], np.float32), np.array([0, 1, 0], np.int32)
        top_p, u = np.ones(3, np.float32), np.array([0.3, 0.7, 0.0], np.float32)
        got = K.sample(dev(logits), dev(temperature), dev(top_k), dev(top_p), dev(u)).get()
        np.testing.assert_array_equal(got, ops.sample(logits, temperature, top_k, top_p, u))
        # greedy, top-k 1
        assert got[0] == int(np.argmax(logits[0])) and got[1] == int(np.argmax(logits[1]))
    else:
        raise AssertionError(
            f"no emulated case for the new kernel {name}: add one to tests/test_stage3_lessons.py"
        )


def test_each_rungs_new_kernels_equal_its_twins_in_the_emulator(
    rungs, packages, monkeypatch, tmp_path
):
    from bench.testbed import cuda_emulator as emu
    from test_stage3_cuda_emulated import shimmed_copy
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    covered = set()
    for k, pkg in packages.items():
        new = _new_kernels(rungs, k)
        if not new:
            continue
        K = importlib.import_module(f"{pkg.__name__}.kernels")
        ops = importlib.import_module(f"{pkg.__name__}.ops")
        cuda = Path(K.__file__).parent / "cuda"
        sources = []
        for f in sorted(set(K.KERNEL_FILES.values())):
            cu = cuda / f
            sources.append(
                cu
                if emu.unsupported(cu.read_text()) is None
                else shimmed_copy(cu, tmp_path / f"r{k}")
            )
        emulated = emu.build(sources, tmp_path / f"build{k}")
        with monkeypatch.context() as m:
            dev = _gpu(K, emulated, m)
            for name in sorted(new):
                _case(name, K, ops, dev, emulated)
                covered.add(name)
    # the series adds every stage-3 kernel somewhere before its end
    stage3 = importlib.import_module("stage3_optimized.kernels")
    assert covered | set(_new_kernels(rungs, len(rungs) - 1)) >= set(stage3.KERNEL_FILES)


# ---- the counted ladder and the figures ----

# a counted figure -> the word a rung's "Costs:" paragraph uses when the figure rises
COST_WORDS = {"launches": "launch", "blas": "cuBLAS", "allocations": "allocation",
              "elementwise": "elementwise", "copies": "cop", "syncs": "wait",
              "bytes_to_host": "to the host", "host_us": "host time",
              "predicted_decode_step_us": "host time", "weight_bytes_per_token": "weight",
              "kv_bytes_per_token": "K/V", "activation_bytes_per_token": "activation",
              "prefill_tokens_computed": "prompt tokens",
              "predicted_prefill_attention_us": "prefill attention"}


def _figures(row: dict) -> dict:
    return dict(row["host_calls"], **{k: row[k] for k in COST_WORDS if k in row})


def test_bench_lessons_counts_each_rungs_host_calls_bytes_and_flops(tmp_path, monkeypatch):
    """The counts docs/stage3.md quotes, for one layer (+ the step's fixed calls): stage 2
    launches 11 kernels and 7 GEMMs per dense decode layer; the fused QKV lesson 7 + 5, the
    fused gate/up 7 + 4; the split decode attention 8 + 4; the add in the GEMM 6 + 4; gemv.cu
    7 kernels and no cuBLAS call, no allocation, one copy in and one out; a graph replay
    launches nothing from the host. The KV bytes halve with bf16 and halve again when read
    once per GQA group of 2; the weight bytes halve with bf16 weights; the activations written
    shrink with bf16 activations; the prefix cache computes fewer prefill tokens; the tensor
    cores predict a faster prefill attention; device sampling brings S ids back instead of
    S x V logits; a figure that rises from one rung to the next is named in that lesson's
    "Costs:"; each rung's predicted host time is the counts x the prices."""
    import json
    from bench import lessons
    monkeypatch.setattr(
        sys, "argv", ["lessons", "--layers", "1", "--save", str(tmp_path / "l.json")]
    )
    assert lessons.main() == 0
    rows = json.loads((tmp_path / "l.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["00-stage2"] + [p.stem for p in series.patches()]
    R = {r["name"].split("-", 1)[1]: r for r in rows}
    H = {name: r["host_calls"] for name, r in R.items()}
    calls = lambda name: (H[name]["launches"], H[name]["blas"])   # noqa: E731
    assert calls("stage2") == (11 + 2, 7 + 1) and H["entry-points"] == H["stage2"]
    assert calls("fused-qkv") == (7 + 2, 5 + 1) and calls("fused-mlp") == (7 + 2, 4 + 1)
    assert calls("gqa-split-decode") == (8 + 2, 4 + 1) and calls("add-in-gemm") == (6 + 3, 4 + 1)
    assert calls("gemv") == (7 + 3, 0)                       # + embedding, lm_head gemv, sample
    assert H["gemv"]["allocations"] == 0 and H["gemv"]["copies"] == 2
    assert H["one-upload"]["copies"] == 2 < H["buffers"]["copies"]
    assert H["buffers"]["allocations"] < H["device-sampling"]["allocations"]
    assert H["bf16-gemm-inputs"] == H["fused-mlp"]          # no conversion left
    last = R["cuda-graphs"]
    g = last["graph_host_calls"]
    counts = (g["launches"], g["blas"], g["allocations"], g["graph_launches"], g["copies"])
    assert counts == (0, 0, 0, 1, 2)
    assert last["graph_host_us"] < last["host_us"] <= R["one-upload"]["host_us"]
    assert all("graph_host_us" not in r for r in rows[:-1])
    kv = lambda name: R[name]["kv_bytes_per_token"]   # noqa: E731
    weights = lambda name: R[name]["weight_bytes_per_token"]   # noqa: E731
    act = lambda name: R[name]["activation_bytes_per_token"]   # noqa: E731
    assert kv("stage2") == 2 * kv("bf16-kv-cache") == 4 * kv("gqa-split-decode") > 0
    assert weights("stage2") == weights("bf16-kv-cache") == 2 * weights("bf16-weights")
    assert act("fused-qkv") < act("prefix-cache")
    assert act("bf16-activations") < act("bf16-gemm-inputs")
    prefill = lambda name: R[name]["prefill_tokens_computed"]   # noqa: E731
    assert prefill("prefix-cache") < prefill("entry-points")
    tc = R["tensor-core-prefill"]["predicted_prefill_attention_us"]
    assert tc < R["gqa-split-decode"]["predicted_prefill_attention_us"]
    V, S = lessons.WORKLOAD["vocab_size"], 4
    assert R["tensor-core-prefill"]["host_calls"]["bytes_to_host"] >= S * V * 4
    assert R["device-sampling"]["host_calls"]["bytes_to_host"] < S * V * 4
    for r in rows:
        assert r["host_us"] == lessons.host_us(r["host_calls"]) > 0
    for p, before, row in zip(series.patches(), rows, rows[1:]):
        costs = series.header(p).split("\nCosts:", 1)[1]
        for k, v in _figures(row).items():
            if k in COST_WORDS and v > _figures(before).get(k, v):
                assert COST_WORDS[k] in costs, f"{p.name}: {k} rises to {v}, unsaid in Costs:"


def test_bench_lessons_throughput_runs_every_rung_to_the_requested_tokens_on_cpu(
    packages, tmp_path
):
    """--throughput without a GPU (bench/gpu_check.sh's dry run): bench.gpu's tiny model and
    workload on each rung's numpy twins; every rung produces every requested token (EOS ignored)
    at a positive rate, and a rung left without its cap is skipped, not run."""
    import argparse
    import time
    from bench import gpu, lessons
    pkgs = ["stage2_batched"] + [p.__name__ for p in packages.values()] + ["stage3_optimized"]
    assert len(pkgs) == len(series.patches()) + 1
    args = argparse.Namespace(workdir=str(tmp_path), seqs=3, rung_cap_s=30.0, deadline_s=600.0)
    requested = sum(gpu.workload(3, seed=1, min_len=4, max_len=12)[1])
    rows = lessons.throughput_all(pkgs, args, time.perf_counter())
    assert (tmp_path / "tiny-qwen3-0.6b-random" / "config.json").is_file()   # bench.gpu's model
    for pkg, r in zip(pkgs, rows):
        assert r["status"] == "ok" and r["device"] == "cpu", (pkg, r)
        assert (
            r["output_tokens"] == r["expected_tokens"] == r["requested_tokens"] == requested > 0
        ), (pkg, r)
        assert r["tok_s"] > 0 and r["preemptions"] == 0, (pkg, r)
    late = lessons.throughput_all(pkgs[:2], argparse.Namespace(**dict(vars(args), deadline_s=10.0)),
                                  time.perf_counter() - 10)
    assert [r["status"] for r in late] == ["skipped: out of time"] * 2


def test_figures_draw_from_small_saved_results(tmp_path):
    """Every figure from saved JSON (the committed docs/figures/*.json, and a two-row ladder),
    without comparing pixels: the files exist, are SVG and carry their command as caption."""
    import json
    pytest.importorskip("matplotlib")
    from bench import figures
    res = tmp_path / "results"
    shutil.copytree(figures.FIGURES, res, ignore=shutil.ignore_patterns("*.svg", "*.png"))
    small = json.loads((res / "stage1_ladder.json").read_text())
    small["rows"] = small["rows"][:2]
    small["command"] = "python -m bench ladder --quick"
    (res / "stage1_ladder.json").write_text(json.dumps(small))
    out = figures.draw_all(res, tmp_path / "out")
    assert [p.name for p in out] == ["stage3_lessons.svg", "stage1_ladder.svg",
                                   "stage1_roofline.svg", "stage1_prefill_tile.svg",
                                   "stage1_speculative.svg"]
    for p in out:
        text = p.read_text()
        assert text.lstrip().startswith("<?xml") and "<svg" in text and len(text) > 3000, p.name
    assert "bench ladder --quick" in (tmp_path / "out" / "stage1_ladder.svg").read_text()
    (res / "lessons.json").unlink()
    with pytest.raises(FileNotFoundError, match="lessons.json"):
        figures.draw_all(res, tmp_path / "out")
