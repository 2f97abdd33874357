"""Stage-1 exercises (and common/sampling.py's), in course order: docs/exercises.md.

Each check imports the student's copy (ws.module) and compares it with the project's own
oracle: the numpy definitions of stage1_cpu/ops.py and quant.Weight.matmul_ref (taken
from the installed package, never from the workspace), or a definition written here.
"""
from __future__ import annotations

import numpy as np

from common.config import ModelConfig
from common.engine import Request
from common.sampling import SamplingParams
from stage1_cpu import ops, quant

from .base import CheckFailed, Exercise, Workspace, assert_close, assert_equal, require


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------
# 1.1 RMSNorm
# ---------------------------------------------------------------------------

def check_rmsnorm(ws: Workspace) -> None:
    K = ws.module("stage1_cpu/norms.py")
    r = _rng(1)
    cases = [
        ("the residual stream [T, C]", (r.normal(0.5, 3.0, (5, 96))), r.normal(1.0, 0.3, 96), 1e-6,
         ("token", "channel")),
        ("q heads [T, H, D] with w [D]", r.normal(0, 2.0, (3, 4, 32)), r.normal(1.0, 0.3, 32), 1e-6,
         ("token", "head", "dim")),
        ("tiny values, where eps matters", r.normal(0, 1e-3, (2, 40)), r.normal(1.0, 0.3, 40), 1e-4,
         ("token", "channel")),
    ]
    for name, x, w, eps, axes in cases:
        x, w = x.astype(np.float32), w.astype(np.float32)
        got = K.rmsnorm(x, w, eps)
        assert_close(f"rmsnorm, {name}", got, ops.rmsnorm(x, w, eps), atol=1e-5, rtol=1e-4, axes_names=axes,
                     hint="x / sqrt(mean(x^2) + eps) * w over the last axis")


# ---------------------------------------------------------------------------
# 1.2 RoPE, rotate-half
# ---------------------------------------------------------------------------

def check_rope(ws: Workspace) -> None:
    K = ws.module("stage1_cpu/kernels.py")
    r = _rng(2)
    for name, T, H, D, theta, p0 in (("positions 0..4, D = 16", 5, 3, 16, 1e4, 0),
                                     ("positions 1000..1002, D = 64", 3, 2, 64, 1e6, 1000)):
        x = r.normal(0, 1, (T, H, D)).astype(np.float32)
        cos, sin = ops.rope_tables(p0 + T, D, theta)
        cos, sin = cos[p0:], sin[p0:]                                # [T, D/2]
        got = K.rope(x, cos, sin)
        want = ops.rope(x, cos, sin)
        hint = "rotate-half: dimension i pairs with i + D/2 (the Hugging Face layout)"
        if np.asarray(got).shape == want.shape and np.allclose(got, _rope_interleaved(x, cos, sin), atol=1e-5):
            hint = ("this is the interleaved form, pairs (2i, 2i+1); Qwen3 is rotate-half: "
                    "dimension i pairs with i + D/2")
        assert_close(f"rope, {name}", got, want, atol=1e-5, rtol=1e-4, hint=hint)


def _rope_interleaved(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x1 * c - x2 * s, x2 * c + x1 * s
    return out


# ---------------------------------------------------------------------------
# 1.3 the softmax inside attention, 1.4 causal GQA attention over the KV cache
# ---------------------------------------------------------------------------

def _attention_cases(large_first: bool):
    """(name, T, H, Hkv, D, start_pos, q scale): decode, prefill, a second chunk, MQA, large scores."""
    cases = [("decode: 1 query at position 9", 1, 4, 2, 16, 9, 1.0),
             ("prefill: 6 queries from position 0 (causal)", 6, 4, 2, 16, 0, 1.0),
             ("a second chunk: 3 queries from position 5", 3, 4, 2, 16, 5, 1.0),
             ("one KV head for 3 query heads", 2, 3, 1, 8, 4, 1.0),
             ("large scores (|q.k|/sqrt(D) in the hundreds)", 4, 4, 2, 16, 3, 60.0)]
    return cases[-1:] + cases[:-1] if large_first else cases


def _check_attention(ws: Workspace, large_first: bool) -> None:
    K = ws.module("stage1_cpu/kernels.py")
    r = _rng(3)
    for name, T, H, Hkv, D, start, scale in _attention_cases(large_first):
        Tmax = start + T + 3
        q = (r.normal(0, 1, (T, H, D)) * scale).astype(np.float32)
        kc = r.normal(0, 1, (Hkv, Tmax, D)).astype(np.float32)
        vc = r.normal(0, 1, (Hkv, Tmax, D)).astype(np.float32)
        kc[:, start + T:] = vc[:, start + T:] = np.nan       # past the last position: never read
        got = K.attention(q, kc, vc, start)
        want = ops.attention(q, kc, vc, start)
        hint = (f"query t sits at position {start} + t and attends to 0 .. {start} + t (causal); "
                f"query head h reads KV head h // {H // Hkv}")
        if "large" in name:
            hint = "subtract each row's largest score before exp, or exp overflows (exp_f32 clamps at 88)"
        if np.isnan(np.asarray(got, dtype=np.float64)).any() and not np.isnan(want).any():
            hint += "; NaN: an output never written, or a cache position past start_pos + T read"
        assert_close(f"attention, {name}", got, want, atol=2e-5, rtol=2e-4, hint=hint)


def check_softmax(ws: Workspace) -> None:
    _check_attention(ws, large_first=True)


def check_attention(ws: Workspace) -> None:
    _check_attention(ws, large_first=False)


# ---------------------------------------------------------------------------
# 1.5 KV reuse across chat turns
# ---------------------------------------------------------------------------

class _ToyModel:
    """A stand-in for model.Model whose KV cache holds token ids: the logits of a position are
    a function of the whole cache up to it, so a stale or shifted cache changes the tokens."""

    def __init__(self, weights, max_ctx, use_numba=True, **kw):
        self.max_ctx, self.V = max_ctx, weights.config.vocab_size
        self.cache = np.full(max_ctx, -1, dtype=np.int64)
        self.calls: list[tuple[int, list[int]]] = []        # (start_pos, tokens) of every forward

    def forward(self, tokens, start_pos, all_logits=False):
        tokens = [int(t) for t in tokens]
        if start_pos + len(tokens) > self.max_ctx:
            raise ValueError("past the cache")
        self.calls.append((int(start_pos), tokens))
        self.cache[start_pos:start_pos + len(tokens)] = tokens
        seen = self.cache[:start_pos + len(tokens)]
        if (seen < 0).any():
            raise CheckFailed(f"forward at position {start_pos} with positions "
                                      f"{int(np.argmax(seen < 0))}.. never written: the cache would hold garbage there")
        h = int((seen * (np.arange(seen.size) * 7919 + 104729)).sum() % 1_000_003)
        logits = np.zeros(self.V, dtype=np.float32)
        logits[h % self.V] = 1.0
        return logits


def _toy_folder() -> str:
    """A model folder holding only config.json (the engine reads its config; the toy model
    stands in for the weights)."""
    import atexit
    import json
    import shutil
    import tempfile
    from pathlib import Path
    folder = Path(tempfile.mkdtemp(prefix="qs-exercise-toy-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=97, hidden_size=32,
        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)))
    return str(folder)


def check_kv_reuse(ws: Workspace) -> None:
    import types
    E = ws.module("stage1_cpu/engine.py")
    folder = _toy_folder()
    cfg = ModelConfig.from_folder(folder)
    E.load_weights = lambda *a, **k: types.SimpleNamespace(config=cfg, fast=None, fmt="none", source="")
    E.Model = _ToyModel

    def engine():
        return E.LLMEngine(folder, max_ctx=200, prefill_chunk=8, progress=False)

    def run(eng, rid, prompt, n=3):
        eng.model.calls.clear()
        eng.add_request(Request(rid, list(prompt), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
        out = []
        while eng.has_work():
            out += [e.token_id for e in eng.step() if e.request_id == rid]
        return out, list(eng.model.calls)

    r = _rng(5)
    a = [int(t) for t in r.integers(3, 97, 11)]
    eng = engine()
    ans1, _ = run(eng, "turn 1", a)
    turns = []
    p2 = a + ans1 + [int(t) for t in r.integers(3, 97, 6)]          # the chat re-sends all, adds a turn
    turns.append(("turn 2 (the conversation so far plus a new message)", p2, len(a) + len(ans1) - 1))
    p3 = p2[:5] + [(p2[5] + 1) % 94 + 3] + p2[6:]                    # an earlier message edited
    turns.append(("turn 3 (the prompt differs from the cache at position 5)", p3, 5))
    turns.append(("turn 4 (the same prompt again)", p3, len(p3) - 1))
    p5 = p3[:9]
    turns.append(("turn 5 (a prompt that is a prefix of the cache)", p5, 8))
    for name, prompt, reused in turns:
        out, calls = run(eng, name, prompt)
        want, _ = run(engine(), "fresh", prompt)
        first = calls[0] if calls else None
        require(first is not None and first[0] == reused,
                f"{name}: the engine fed the prompt from position {first[0] if first else '?'}, expected "
                f"{reused}: the cache holds the prompt's first {reused} tokens (it must feed at least one "
                f"token to get logits)")
        fed = [t for _, ts in calls for t in ts][:len(prompt) - reused]
        require(fed == prompt[reused:], f"{name}: fed tokens {fed}, expected the prompt's tokens "
                                        f"{prompt[reused:]} from position {reused}")
        require(out == want, f"{name}: the tokens {out} differ from those of a fresh engine fed the whole "
                             f"prompt, {want}: the cache held stale positions")


# ---------------------------------------------------------------------------
# 1.6 MoE top-k routing, 1.7 grouping a prefill's tokens per expert
# ---------------------------------------------------------------------------

def check_route(ws: Workspace) -> None:
    K = ws.module("stage1_cpu/kernels.py")
    r = _rng(6)
    ties = np.round(r.normal(0, 1, (4, 16)) * 2) / 2                     # many equal logits
    for name, logits, k, norm in (("8 experts, top 2, renormalised", r.normal(0, 2, (5, 8)), 2, True),
                                  ("8 experts, top 2, not renormalised", r.normal(0, 2, (5, 8)), 2, False),
                                  ("16 experts, top 4, ties (the lower id first)", ties, 4, True),
                                  ("128 experts, top 8, large logits", r.normal(0, 30, (3, 128)), 8, True),
                                  ("top 1", r.normal(0, 1, (3, 6)), 1, False)):
        logits = logits.astype(np.float32)
        top, weight = K.route(logits, k, norm)
        want_top, want_w = ops.route(logits, k, norm)
        assert_equal(f"route, {name}: the chosen experts", top, want_top, axes_names=("token", "slot"),
                     hint="the k largest logits, best first; a tie goes to the lower expert id")
        assert_close(f"route, {name}: the weights", weight, want_w, atol=1e-6, rtol=1e-5,
                     axes_names=("token", "slot"),
                     hint="softmax over all E experts" + (", then renormalised over the k to sum to 1 "
                                                          "(norm_topk_prob)" if norm else ", not renormalised"))


class _Stack:
    """A stand-in for a quant.Weight that stacks E experts' matrices by rows: it counts which
    rows part() takes and how many token rows each matmul multiplies."""

    def __init__(self, data, log):
        self.data, self.out_features, self.log = data, data.shape[0], log

    def part(self, r0, r1):
        self.log.append((int(r0), int(r1)))
        return _Part(self.data[r0:r1])


class _Part:
    def __init__(self, data):
        self.data, self.out_features = data, data.shape[0]

    def matmul(self, x):
        return (np.asarray(x, dtype=np.float64) @ self.data.T.astype(np.float64)).astype(np.float32)


def check_experts(ws: Workspace) -> None:
    import types
    M = ws.module("stage1_cpu/model.py")
    r = _rng(7)
    E, k, T, C, n = 6, 2, 7, 10, 5
    logits = r.normal(0, 1, (T, E))
    logits[:, 3] += 3                                                    # expert 3: every token's choice
    logits[:, 5] -= 9                                                    # expert 5: nobody's
    top = np.argsort(-logits, axis=1)[:, :k].astype(np.int64)             # [T, k]
    fake = types.SimpleNamespace(config=types.SimpleNamespace(num_experts=E, num_experts_per_tok=k))
    for name, rows in (("gate_up: every slot of a token reads the token's row, x [T, C]", T),
                       ("down: slot j of token t reads row t k + j, x [T k, C]", T * k)):
        w = r.normal(0, 1, (E * n, C)).astype(np.float32)
        x = r.normal(0, 1, (rows, C)).astype(np.float32)
        log: list = []
        got = M.Model.experts(fake, _Stack(w, log), x, top)
        want = np.empty((T * k, n), dtype=np.float64)
        for t in range(T):
            for j in range(k):
                e = top[t, j]
                want[t * k + j] = (x[t * k + j] if rows == T * k else x[t]).astype(np.float64) @ w[e * n:(e + 1) * n].T
        assert_close(f"experts, {name}", got, want, atol=1e-5, rtol=1e-4, axes_names=("slot", "output"),
                     hint="slot t k + j holds token t's j-th expert top[t, j] times its input row")
        for r0, r1 in log:
            require(r0 % n == 0 and r1 == r0 + n,
                    f"experts, {name}: part({r0}, {r1}) is not one expert's rows (expert e is rows e*{n} .. (e+1)*{n})")
        taken = [r0 // n for r0, _ in log]
        for e in sorted(set(taken)):
            require(taken.count(e) == 1, f"experts, {name}: expert {e}'s rows were taken {taken.count(e)} times; "
                                         "group the slots per expert so that each chosen expert is read once")
        require(5 not in taken, f"experts, {name}: expert 5, which no token chose, was read")


# ---------------------------------------------------------------------------
# 1.8 int8 group quantization, 1.9 its fused dequantize-matvec
# 1.10 int4 packing, 1.11 its matvec
# ---------------------------------------------------------------------------

def _groups(seed: int) -> np.ndarray:
    """[R, G, gs] weight groups with the awkward cases: an all-zero group, a constant group,
    a group whose largest |w| is negative, an outlier, tiny and large scales."""
    r = _rng(seed)
    g = r.normal(0, 0.05, (5, 4, 32)).astype(np.float32)
    g[0, 1] = 0.0                                   # all zero
    g[1, 2] = 0.3                                   # constant
    g[2, 0, 7] = -0.9                               # the largest |w| is negative
    g[3, 3, 31] = 2.5                               # an outlier
    g[4, 0] *= 1e-3                                 # a tiny scale
    g[4, 1] *= 40.0                                 # a large one
    return g


def _near_half(v: np.ndarray) -> np.ndarray:
    """Where v sits so close to k + 1/2 that dividing or multiplying by the inverse may round
    either way: a difference of 1 is accepted there."""
    return np.abs(np.abs(v - np.floor(v)) - 0.5) < 1e-4


def _f16(v) -> str:
    return f"{float(v):.6g} (fp16 bits 0x{int(np.float16(v).view(np.uint16)):04x})"


def _check_types(name, got, dtypes):
    require(isinstance(got, tuple) and len(got) == len(dtypes),
            f"{name} returns {type(got).__name__}, expected a tuple of {len(dtypes)} arrays")
    for i, (a, dt) in enumerate(zip(got, dtypes)):
        require(isinstance(a, np.ndarray) and a.dtype == dt,
                f"{name}: result {i} is {getattr(a, 'dtype', type(a).__name__)}, expected {np.dtype(dt).name}")


def check_quantize_int8(ws: Workspace) -> None:
    Q = ws.module("stage1_cpu/quant.py")
    g = _groups(8)
    got = Q._quantize_int8(g.copy())
    _check_types("_quantize_int8", got, (np.int8, np.float16))
    q, s = got
    want_s = (np.abs(g).max(axis=-1) / 127.0).astype(np.float16)                     # [R, G]
    assert_equal("int8 scale", s, want_s, axes_names=("row", "group"), show=_f16,
                 hint="s = the group's largest |w| / 127, stored as fp16")
    sf = want_s.astype(np.float32)[:, :, None]
    ratio = np.divide(g, sf, out=np.zeros_like(g), where=sf > 0)
    want_q = np.clip(np.rint(ratio), -127, 127)
    bad = (q.astype(np.int64) != want_q) & ~(_near_half(ratio) & (np.abs(q - want_q) == 1))
    assert_equal("int8 q", np.where(bad, q, want_q).astype(np.int64), want_q.astype(np.int64),
                 axes_names=("row", "group", "index"),
                 hint="q = round(w / s) with the stored fp16 scale, clipped to [-127, 127]; an all-zero group is 0")


def check_quantize_int4(ws: Workspace) -> None:
    Q = ws.module("stage1_cpu/quant.py")
    g = _groups(9)
    got = Q._quantize_int4(g.copy())
    _check_types("_quantize_int4", got, (np.uint8, np.float16, np.float16))
    packed, s, m = got
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    want_s, want_m = ((hi - lo) / 15.0).astype(np.float16), lo.astype(np.float16)
    assert_equal("int4 scale", s, want_s, axes_names=("row", "group"), show=_f16,
                 hint="s = (max - min) / 15 of the group, stored as fp16")
    assert_equal("int4 min", m, want_m, axes_names=("row", "group"), show=_f16,
                 hint="m = the group's minimum, stored as fp16")
    sf = want_s.astype(np.float32)[:, :, None]
    ratio = np.divide(g - want_m.astype(np.float32)[:, :, None], sf, out=np.zeros_like(g), where=sf > 0)
    want_q = np.clip(np.rint(ratio), 0, 15).astype(np.int64)             # [R, G, gs]
    require(packed.shape == (g.shape[0], g.shape[1] // 2, g.shape[2]),
            f"int4 packed: shape {list(packed.shape)}, expected {[g.shape[0], g.shape[1] // 2, g.shape[2]]} "
            "(two groups per byte)")
    lo_n, hi_n = (packed & 15).astype(np.int64), (packed >> 4).astype(np.int64)   # [R, G/2, gs]
    for half, nib, groups in (("low", lo_n, "2p"), ("high", hi_n, "2p+1")):
        want = want_q[:, 0::2] if half == "low" else want_q[:, 1::2]
        r = ratio[:, 0::2] if half == "low" else ratio[:, 1::2]
        bad = (nib != want) & ~(_near_half(r) & (np.abs(nib - want) == 1))
        assert_equal(f"int4 packed, the {half} nibbles", np.where(bad, nib, want), want,
                     axes_names=("row", "pair", "index"),
                     hint=f"byte j of pair p holds weight j of group {groups} in its {half} nibble; "
                          "q = round((w - m) / s) in [0, 15]")


def _matvec_case(fmt: str, seed: int):
    r = _rng(seed)
    O, K, gs = 37, 100, 32                              # 100 inputs: groups padded with zeros
    w = r.normal(0, 0.2, (O, K)).astype(np.float32)
    w[:, 64:96] *= 8.0                                  # one group per row much larger: its scale matters
    W = quant.quantize(w, fmt, gs)
    x = np.zeros((3, W.padded_in), dtype=np.float32)
    x[:, :K] = r.normal(0, 1, (3, K))
    want = x[:, :K].astype(np.float64) @ W.dequantize().astype(np.float64).T     # [T, O]
    return W, x, want


def check_matvec_int8(ws: Workspace) -> None:
    Mm = ws.module("stage1_cpu/matmul.py")
    W, x, want = _matvec_case("int8", 10)
    gs = W.group_size
    for T in (1, 3):
        out = np.full((T, W.out_features), np.nan, dtype=np.float32)
        Mm.matmul_int8(x[:T].reshape(T, -1, gs), W.data, W.scales, out)
        assert_close(f"matmul_int8, {T} token(s)", out, want[:T], atol=1e-4, rtol=1e-4,
                     axes_names=("token", "row"), hint="out[t, r] = sum over groups g of s[r, g] * sum_j q[r, g, j] x[t, g, j]")


def check_matvec_int4(ws: Workspace) -> None:
    Mm = ws.module("stage1_cpu/matmul.py")
    W, x, want = _matvec_case("int4", 11)
    gs = W.group_size
    for T in (1, 3):
        out = np.full((T, W.out_features), np.nan, dtype=np.float32)
        Mm.matmul_int4(x[:T].reshape(T, -1, 2, gs), W.data, W.scales, W.mins, out)
        assert_close(f"matmul_int4, {T} token(s)", out, want[:T], atol=1e-4, rtol=1e-4,
                     axes_names=("token", "row"),
                     hint="W = nibble * s + m per group, so a group adds s * sum(nibble x) + m * sum(x); "
                          "the low nibble is group 2p, the high one group 2p+1")


# ---------------------------------------------------------------------------
# 1.12 the penalties, 1.13 top-k / top-p / min-p (common/sampling.py)
# ---------------------------------------------------------------------------

def _penalised(logits, rep, presence, frequency, prompt, output):
    """The definition (vLLM's, as common/sampling.py's docstring says): repetition over prompt
    and output (divides a positive logit, multiplies a negative one), presence once and
    frequency per occurrence over the output only."""
    out = logits.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= presence + frequency * output.count(t)
    return out


def check_penalties(ws: Workspace) -> None:
    S = ws.module("common/sampling.py")
    r = _rng(12)
    logits = r.normal(0, 2, 20).astype(np.float32)
    prompt, output = [1, 2, 3, 3, 9], [3, 5, 5, 5, 7, 9, 9]
    for name, rep, pres, freq, out_ids in (
            ("repetition penalty 1.3 (prompt and output)", 1.3, 0.0, 0.0, output),
            ("presence penalty 0.5 (once per distinct output token)", 1.0, 0.5, 0.0, output),
            ("frequency penalty 0.3 (per occurrence in the output)", 1.0, 0.0, 0.3, output),
            ("all three: repetition 1.2, presence 0.4, frequency 0.25", 1.2, 0.4, 0.25, output),
            ("presence 0.5 with no output yet", 1.0, 0.5, 0.0, [])):
        params = S.SamplingParams(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
        before = logits.copy()
        got = S.apply_penalties(logits, params, list(prompt), list(out_ids))
        require(np.array_equal(logits, before), f"apply_penalties, {name}: it changed the caller's logits "
                                                "(return a penalised copy)")
        assert_close(f"apply_penalties, {name}", got, _penalised(logits, rep, pres, freq, prompt, out_ids),
                     atol=1e-5, rtol=1e-5, axes_names=("token id",))


def _filtered(logits, temperature, top_k, top_p, min_p):
    """The definition: logits / temperature; top-k keeps the k largest (ties at the k-th value
    all stay); top-p keeps, in order of probability, every token whose preceding mass is below
    top_p (the most likely always stays); min-p drops p < min_p * p(most likely). Probabilities
    are those after top-k, in float64. Dropped tokens are -inf."""
    x = logits.astype(np.float64) / temperature
    V = x.size
    if 0 < top_k < V:
        x[x < np.sort(x)[V - top_k]] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = np.isfinite(x)
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        keep[order[before >= top_p]] = False
    if min_p > 0.0:
        keep &= p >= min_p * p.max()
    return np.where(keep, x, -np.inf)


def check_filters(ws: Workspace) -> None:
    S = ws.module("common/sampling.py")
    r = _rng(13)
    logits = (r.normal(0, 2, 40)).astype(np.float32)
    ties = np.array([3.0, 1.0, 2.0, 2.0, 2.0, 0.5, -1.0, 2.0], dtype=np.float32)
    # probabilities 0.5, 0.25, 0.125, ...: with top_p 0.76 the third token's preceding mass is 0.75,
    # so it stays (and takes the kept mass past top_p)
    halves = np.log(np.array([0.5, 0.25, 0.125, 0.0625, 0.0625])).astype(np.float32)
    for name, lg, kw in (("temperature 0.7, top_k 5", logits, dict(temperature=0.7, top_k=5)),
                         ("top_k 3 with ties at the 3rd value (all tied tokens stay)", ties, dict(top_k=3)),
                         ("top_p 0.8", logits, dict(top_p=0.8)),
                         ("top_p 0.76: the token whose mass crosses it stays", halves, dict(top_p=0.76)),
                         ("top_p 0.5 over four equal tokens: the third's preceding mass is 0.5 exactly, it goes",
                          np.zeros(4, dtype=np.float32), dict(top_p=0.5)),
                         ("min_p 0.1 at temperature 1.5", logits, dict(temperature=1.5, min_p=0.1)),
                         ("top_k 10, top_p 0.9, min_p 0.05", logits, dict(top_k=10, top_p=0.9, min_p=0.05)),
                         ("top_k 100 (more than the vocabulary: no effect)", logits, dict(top_k=100))):
        kw = dict(dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), **kw)
        got = np.asarray(S.filter_logits(lg.copy(), S.SamplingParams(**kw)), dtype=np.float64)
        want = _filtered(lg, kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"])
        opts = ", ".join(f"{k_}={v}" for k_, v in kw.items())
        require(got.shape == want.shape, f"filter_logits, {name}: shape {list(got.shape)}, expected {list(want.shape)}")
        kept_got, kept_want = np.isfinite(got), np.isfinite(want)
        if (kept_got != kept_want).any():
            t = int(np.argmax(kept_got != kept_want))
            raise CheckFailed(f"filter_logits, {name} ({opts}): token {t} (logit {float(lg[t]):.4g}) should be "
                              f"{'kept' if kept_want[t] else 'dropped'}, got {'kept' if kept_got[t] else 'dropped'}; "
                              f"{int(kept_want.sum())} tokens should stay, {int(kept_got.sum())} did")
        assert_close(f"filter_logits, {name}: the kept logits", np.where(kept_want, got, 0), np.where(kept_want, want, 0),
                     atol=1e-5, rtol=1e-5, axes_names=("token id",), hint="kept logits are logits / temperature")


# ---------------------------------------------------------------------------
# 1.14 the acceptance rule of speculative sampling (stage1_cpu/speculative.py)
# ---------------------------------------------------------------------------

P_FAIL = 1e-6       # a right answer fails a chi-square case for one seed in a million (the seeds are fixed)


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's chi-square test of counts [cells] against the distribution expected [cells]:
    each cell expected 5 times or more on its own, the rarer ones pooled (into the smallest cell
    when the pool itself is expected under 5 times) -> (p-value, degrees of freedom)."""
    import torch    # here, as in tiny_model: only the checks that count draws need its incomplete gamma
    counts, e = np.asarray(counts, dtype=np.float64).ravel(), counts.sum() * np.asarray(expected).ravel()
    big, rare = e >= 5, (e < 5) & (e > 0)
    obs, exp = list(counts[big]), list(e[big])
    if e[rare].sum() >= 5:
        obs, exp = obs + [counts[rare].sum()], exp + [e[rare].sum()]
    elif rare.any():
        j = int(np.argmin(exp))
        obs[j], exp[j] = obs[j] + counts[rare].sum(), exp[j] + e[rare].sum()
    x = float(sum((o - m) ** 2 / m for o, m in zip(obs, exp)))
    df = len(obs) - 1
    sf = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64))
    return float(sf), df


def _speculate(accept, P: np.ndarray, Q: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, int]:
    """n runs of speculative sampling on a toy model over V tokens whose next-token distribution
    depends on the previous token only: P [V+1, V] the model's (row V: after the prompt), Q the
    draft's. Each run drafts 3 tokens from Q's chain, checks them in order with accept(p, q, x, rng),
    and after a rejection draws plainly from P -> (counts of the first 3 tokens [V, V, V], how many
    runs kept their first draft)."""
    V, r = P.shape[1], _rng(seed)
    draw = lambda rows, u: (u[:, None] > np.cumsum(rows, -1)[:, :-1]).sum(-1)  # noqa: E731  (inverse cdf)
    drafts = [draw(Q[np.full(n, V)], r.random(n))]
    for _ in range(2):                          # every run's 3 drafts at once, each from q after the last
        drafts.append(draw(Q[drafts[-1]], r.random(n)))
    counts, kept_first = np.zeros((V, V, V), dtype=np.int64), 0
    for run in range(n):
        out, prev = [], V
        for x in (int(d[run]) for d in drafts):
            ok, y = accept(P[prev].copy(), Q[prev].copy(), x, r)
            require(0 <= int(y) < V and (not ok or int(y) == x),
                    f"accept_draft returned ({ok!r}, {y!r}) for draft {x}: (True, x) or (False, a token id in 0..{V - 1})")
            kept_first += bool(ok) and not out
            out.append(int(y))
            prev = int(y)
            if not ok:
                break
        while len(out) < 3:                     # the next steps: plain draws from the model
            out.append(int(draw(P[prev][None], r.random(1))[0]))
            prev = out[-1]
        counts[tuple(out)] += 1
    return counts, kept_first


def check_acceptance(ws: Workspace) -> None:
    S = ws.module("stage1_cpu/speculative.py")
    V, N = 4, 3_000
    r = _rng(14)
    soft = lambda z: np.exp(z) / np.exp(z).sum(-1, keepdims=True)  # noqa: E731
    P = soft(r.normal(0, 1.2, (V + 1, V)))
    for name, Q, seed in (("a draft drawn from another model's distribution q", soft(r.normal(0, 1.2, (V + 1, V))), 15),
                          ("a draft picked without chance (q one-hot, as prompt lookup's)",
                           np.eye(V)[r.integers(0, V, V + 1)], 16)):
        counts, kept = _speculate(S.accept_draft, P, Q, N, seed)
        joint = P[V][:, None, None] * P[:V][:, :, None] * P[:V][None, :, :]     # p(a) p(b | a) p(c | b)
        p_value, df = chi_square_p(counts, joint)
        require(p_value > P_FAIL, f"{name}: the first three tokens of {N} runs do not follow the model's distribution "
                                  f"(chi-square p = {p_value:.1e} over {df + 1} cells): keep a draft x with probability "
                                  "min(1, p[x] / q[x]), and replace a rejected one by a draw from max(0, p - q), "
                                  "normalised")
        want = np.minimum(P[V], Q[V]).sum()                     # the rule's acceptance: sum min(p, q)
        got, sd = kept / N, np.sqrt(want * (1 - want) / N)
        require(abs(got - want) < 5.3 * sd + 1e-12,
                f"{name}: the tokens follow the model's distribution, but {got:.1%} of first drafts were accepted "
                f"where min(1, p[x] / q[x]) accepts {want:.1%}: accept by that probability, not by another test")


S1 = "docs/stage1.md"
KERNELS = f"{S1}#7-the-kernels"
MODEL = f"{S1}#3-modelpy-the-forward-pass"
MOE = f"{S1}#3b-mixture-of-experts-routing-grouping-bytes-per-token"
QUANT = f"{S1}#6-quantpy-fewer-bytes-per-token"
SAMPLING = "docs/chat.md#sampling-defaults"

EXERCISES: list[Exercise] = [
    Exercise("1.1", "RMSNorm of one row", MODEL, "easy", "stage1_cpu/norms.py", check=check_rmsnorm),
    Exercise("1.2", "RoPE, rotate-half, of one head", MODEL, "easy", "stage1_cpu/kernels.py", check=check_rope),
    Exercise("1.3", "a numerically safe softmax (inside attention)", KERNELS, "easy", "stage1_cpu/kernels.py",
             check=check_softmax),
    Exercise("1.4", "causal GQA attention over the KV cache", MODEL, "medium", "stage1_cpu/kernels.py",
             check=check_attention),
    Exercise("1.5", "KV reuse across chat turns", f"{S1}#2-enginepy-prefill-then-decode", "easy",
             "stage1_cpu/engine.py", check=check_kv_reuse),
    Exercise("1.6", "MoE top-k routing with renormalisation", MOE, "medium", "stage1_cpu/kernels.py",
             check=check_route),
    Exercise("1.7", "grouping a prefill's tokens per expert", MOE, "medium", "stage1_cpu/model.py",
             check=check_experts),
    Exercise("1.8", "int8 group quantization", QUANT, "easy", "stage1_cpu/quant.py", check=check_quantize_int8),
    Exercise("1.9", "the fused int8 dequantize-matvec row", QUANT, "medium", "stage1_cpu/matmul.py",
             check=check_matvec_int8),
    Exercise("1.10", "int4 quantization and packing", QUANT, "medium", "stage1_cpu/quant.py",
             check=check_quantize_int4),
    Exercise("1.11", "the fused int4 dequantize-matvec row", QUANT, "hard", "stage1_cpu/matmul.py",
             check=check_matvec_int4),
    Exercise("1.12", "repetition, presence and frequency penalties", SAMPLING, "easy", "common/sampling.py",
             check=check_penalties),
    Exercise("1.13", "top-k, top-p and min-p filters", SAMPLING, "medium", "common/sampling.py",
             check=check_filters),
    Exercise("1.14", "the acceptance rule of speculative sampling", f"{S1}#15-speculativepy-several-tokens-per-step",
             "medium", "stage1_cpu/speculative.py", check=check_acceptance),
]
