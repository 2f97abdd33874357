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
        x64, C = x.astype(np.float64), x.shape[-1]
        ms = (x64 * x64).mean(axis=-1, keepdims=True)
        mistakes = [("divided by sqrt(sum of x^2): divide the sum of squares by C, the row's "
                     "length, for the mean", x64 / np.sqrt(ms * C + eps) * w),
                    ("eps belongs inside the square root: sqrt(mean(x^2) + eps), not "
                     "sqrt(mean(x^2)) + eps", x64 / (np.sqrt(ms) + eps) * w),
                    ("the normalised row is not scaled: multiply channel c by its weight w[c]",
                     x64 / np.sqrt(ms + eps))]
        assert_close(f"rmsnorm, {name}", got, ops.rmsnorm(x, w, eps), atol=1e-5, rtol=1e-4,
                     axes_names=axes, hint="x / sqrt(mean(x^2) + eps) * w over the last axis",
                     mistakes=mistakes)


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
        mistakes = [("this is the interleaved form, pairs (2i, 2i+1); Qwen3 pairs dimension i "
                     "with i + D/2 (rotate-half, the Hugging Face layout)",
                     _rope_interleaved(x, cos, sin)),
                    ("rotated by minus the angle: the sign of sin is flipped (the first half gets "
                     "x1 cos - x2 sin, the second x2 cos + x1 sin)", ops.rope(x, cos, -sin)),
                    ("cos and sin are swapped: cos multiplies a dimension's own value, sin its "
                     "partner's", ops.rope(x, sin, cos))]
        assert_close(f"rope, {name}", got, want, atol=1e-5, rtol=1e-4, mistakes=mistakes,
                     hint="rotate-half: dimension i pairs with i + D/2 (the Hugging Face layout)")


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
    """(name, T, H, Hkv, D, start_pos, q scale): decode, prefill, a second chunk, MQA, large
    scores."""
    cases = [("decode: 1 query at position 9", 1, 4, 2, 16, 9, 1.0),
             ("prefill: 6 queries from position 0 (causal)", 6, 4, 2, 16, 0, 1.0),
             ("a second chunk: 3 queries from position 5", 3, 4, 2, 16, 5, 1.0),
             ("one KV head for 3 query heads", 2, 3, 1, 8, 4, 1.0),
             ("large scores (|q.k|/sqrt(D) in the hundreds)", 4, 4, 2, 16, 3, 60.0)]
    return cases[-1:] + cases[:-1] if large_first else cases


def _attention_np(q, kc, vc, start: int, scaled: bool = True,
                  seen=lambda start, t, T: start + t + 1, exps: bool = True,
                  normalised: bool = True) -> np.ndarray:
    """Attention in float64 as a mistake computes it: query t sees the first seen(start, t, T)
    positions, its scores scaled by 1/sqrt(D) or not, weighted by exp(s - max) or by the scores
    themselves (exps False), divided by the sum of the exponentials or not."""
    T, H, D = q.shape
    group = H // kc.shape[0]
    out = np.full(q.shape, np.nan)
    for t in range(T):
        n = seen(start, t, T)
        for h in range(H if n > 0 else 0):         # a query that sees nothing: NaN
            k, v = kc[h // group, :n].astype(np.float64), vc[h // group, :n].astype(np.float64)
            s = k @ q[t, h].astype(np.float64) * (1 / np.sqrt(D) if scaled else 1.0)
            e = np.exp(s - s.max())
            out[t, h] = (e if exps else s) @ v / (e.sum() if normalised else 1.0)
    return out


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
        hint = (f"query t sits at position {start} + t and sees positions 0 .. {start} + t; query "
                f"head h reads KV head h // {H // Hkv}; scores are q . k / sqrt(D)")
        if "large" in name:
            hint = ("subtract each row's largest score before exp, or exp overflows "
                    "(exp_f32 clamps at 88)")
        if np.isnan(np.asarray(got, dtype=np.float64)).any() and not np.isnan(want).any():
            hint += "; NaN: an output never written, or a cache position past start_pos + T read"
        args = (q, kc, vc, start)
        mistakes = [  # 1.4's, then 1.3's
            ("the scores are q . k without the 1/sqrt(D) scale",
             _attention_np(*args, scaled=False)),
            (f"query t left out its own position: it sees positions 0 .. {start} + t, itself "
             "included", _attention_np(*args, seen=lambda start, t, T: start + t)),
            (f"query t also saw later positions, up to {start} + {T - 1}: it sees 0 .. "
             f"{start} + t only", _attention_np(*args, seen=lambda start, t, T: start + T)),
            ("not normalised: divide the weighted sum by the sum of the exponentials, ssum[g]",
             _attention_np(*args, normalised=False)),
            ("the exponentials must replace the scores (scores[g, j] = e): the weighted sum "
             "after the region reads scores[g, j] as the weights",
             _attention_np(*args, exps=False))]
        assert_close(f"attention, {name}", got, want, atol=2e-5, rtol=2e-4, hint=hint,
                     mistakes=mistakes)


def check_softmax(ws: Workspace) -> None:
    _check_attention(ws, large_first=True)


def check_attention(ws: Workspace) -> None:
    _check_attention(ws, large_first=False)


# ---------------------------------------------------------------------------
# 1.5 KV reuse across chat turns
# ---------------------------------------------------------------------------

class _ToyModel:
    """A stand-in for model.build_model's model whose KV cache holds token ids: the logits of a
    position are a function of the whole cache up to it, so a stale or shifted cache changes the
    tokens."""

    def __init__(self, weights, max_ctx, use_numba=True):
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
                                      f"{int(np.argmax(seen < 0))}.. never written: the cache "
                                      "would hold garbage there")
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
    E.load_weights = lambda *a, **k: types.SimpleNamespace(config=cfg, fast=None,
                                                           fmt="none", source="")
    E.build_model = _ToyModel

    def engine():
        return E.LLMEngine(folder, max_ctx=200, prefill_chunk=8, progress=False)

    def run(eng, rid, prompt, n=3):
        eng.model.calls.clear()
        eng.add_request(Request(rid, list(prompt),
                                SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
        out = []
        while eng.has_work():
            out += [e.token_id for e in eng.step() if e.request_id == rid]
        return out, list(eng.model.calls)

    r = _rng(5)
    a = [int(t) for t in r.integers(3, 97, 11)]
    eng = engine()
    ans1, _ = run(eng, "turn 1", a)
    turns = []
    # the chat re-sends all, adds a turn
    p2 = a + ans1 + [int(t) for t in r.integers(3, 97, 6)]
    turns.append(("turn 2 (the conversation so far plus a new message)", p2,
                  len(a) + len(ans1) - 1))
    p3 = p2[:5] + [(p2[5] + 1) % 94 + 3] + p2[6:]                    # an earlier message edited
    turns.append(("turn 3 (the prompt differs from the cache at position 5)", p3, 5))
    turns.append(("turn 4 (the same prompt again)", p3, len(p3) - 1))
    p5 = p3[:9]
    turns.append(("turn 5 (a prompt that is a prefix of the cache)", p5, 8))
    for name, prompt, reused in turns:
        out, calls = run(eng, name, prompt)
        want, _ = run(engine(), "fresh", prompt)
        fed_from = calls[0][0] if calls else len(prompt)
        what = (f"{name}: the engine fed the prompt from position {fed_from} of {len(prompt)}, "
                f"expected {reused}")
        require(fed_from != len(prompt), f"{what}: it must feed at least its last token, for the "
                                         "logits (the match stops at len(prompt) - 1)")
        require(fed_from <= reused, f"{what}: the cache matches the prompt's first {reused} "
                                    "tokens only; the ids it holds after them are stale (cut "
                                    "cached_ids to the match)")
        require(fed_from >= reused, f"{what}: the prompt's first {reused} tokens are already in "
                                    "the cache (count the ids matching cached_ids from the start)")
        fed = [t for _, ts in calls for t in ts][:len(prompt) - reused]
        require(fed == prompt[reused:], f"{name}: fed tokens {fed}, expected the prompt's tokens "
                                        f"{prompt[reused:]} from position {reused}")
        require(out == want, f"{name}: the tokens {out} differ from those of a fresh engine fed "
                             f"the whole prompt, {want}: the cache held stale positions")


# ---------------------------------------------------------------------------
# 1.6 MoE top-k routing, 1.7 grouping a prefill's tokens per expert
# ---------------------------------------------------------------------------

def check_route(ws: Workspace) -> None:
    K = ws.module("stage1_cpu/kernels.py")
    r = _rng(6)
    ties = np.round(r.normal(0, 1, (4, 16)) * 2) / 2                     # many equal logits
    for name, logits, k, norm in (("8 experts, top 2, renormalised",
                                   r.normal(0, 2, (5, 8)), 2, True),
                                  ("8 experts, top 2, not renormalised",
                                   r.normal(0, 2, (5, 8)), 2, False),
                                  ("16 experts, top 4, ties (the lower id first)", ties, 4, True),
                                  ("128 experts, top 8, large logits",
                                   r.normal(0, 30, (3, 128)), 8, True),
                                  ("top 1", r.normal(0, 1, (3, 6)), 1, False)):
        logits = logits.astype(np.float32)
        top, weight = K.route(logits, k, norm)
        want_top, want_w = ops.route(logits, k, norm)
        # ties to the higher id: the order of the reversed logits, read back as ids
        higher = logits.shape[1] - 1 - np.argsort(-logits[:, ::-1], axis=1, kind="stable")[:, :k]
        assert_equal(f"route, {name}: the chosen experts", top, want_top,
                     axes_names=("token", "slot"),
                     hint="the k largest logits, best first; a tie goes to the lower expert id",
                     mistakes=[("a tie went to the higher id: among equal logits the lower "
                                "expert id comes first (compare with >, not >=)", higher)])
        probs = np.exp(logits - logits.max(1, keepdims=True)).astype(np.float64)
        chosen = np.take_along_axis(probs, want_top, 1)                   # exp(l - max) of the k
        mistakes = [("the weights are exp(l - max) without the softmax's denominator: divide by "
                     "the sum of exp over all E experts",
                     chosen / (chosen.sum(1, keepdims=True) if norm else 1))]
        mistakes += [("the k weights must be renormalised to sum to 1 (norm_topk_prob)",
                      chosen / probs.sum(1, keepdims=True))] if norm else []
        rest = ", then divided by the k weights' sum (norm_topk_prob)" if norm else ", nothing more"
        assert_close(f"route, {name}: the weights", weight, want_w, atol=1e-6, rtol=1e-5,
                     axes_names=("token", "slot"), mistakes=mistakes,
                     hint="softmax over every expert" + rest)


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
    # expert 3: every token's choice
    logits[:, 3] += 3
    logits[:, 5] -= 9                                                    # expert 5: nobody's
    top = np.argsort(-logits, axis=1)[:, :k].astype(np.int64)             # [T, k]
    fake = types.SimpleNamespace(config=types.SimpleNamespace(num_experts=E, num_experts_per_tok=k))
    for name, rows in (("gate_up: every slot of a token reads the token's row, x [T, C]", T),
                       ("down: slot j of token t reads its own row, x [T k, C]", T * k)):
        w = r.normal(0, 1, (E * n, C)).astype(np.float32)
        x = r.normal(0, 1, (rows, C)).astype(np.float32)
        log: list = []
        got = M.Model.experts(fake, _Stack(w, log), x, top)
        want, token_rows = np.empty((T * k, n)), np.empty((T * k, n))       # float64
        x64 = x.astype(np.float64)
        for t in range(T):
            for j in range(k):
                rows_e = w[top[t, j] * n:(top[t, j] + 1) * n].T.astype(np.float64)
                want[t * k + j] = (x64[t * k + j] if rows == T * k else x64[t]) @ rows_e
                token_rows[t * k + j] = x64[t] @ rows_e
        for r0, r1 in log:
            require(r0 % n == 0 and r1 == r0 + n,
                    f"experts, {name}: part({r0}, {r1}) is not one expert's rows (expert e is rows "
                    f"e*{n} .. (e+1)*{n})")
        taken = [r0 // n for r0, _ in log]
        for e in sorted(set(taken)):
            require(taken.count(e) == 1, f"experts, {name}: expert {e}'s rows were taken "
                                         f"{taken.count(e)} times; group the slots per expert so "
                                         "that each chosen expert is read once")
        require(5 not in taken, f"experts, {name}: expert 5, which no token chose, was read")
        mistakes = [("down reads a row per slot: slot t k + j multiplies row t k + j of x, not "
                     "token t's row", token_rows)] if rows == T * k else []
        assert_close(f"experts, {name}", got, want, atol=1e-5, rtol=1e-4,
                     axes_names=("slot", "output"), mistakes=mistakes,
                     hint="slot t k + j holds token t's j-th expert top[t, j] times its input row")


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


def _rounds_as(q, ratio, rounding, lo: int, hi: int) -> bool:
    """q is rounding(ratio) clipped to [lo, hi], but where ratio sits within 1e-4 of a rounding
    edge (a half or a whole number: a student's w * (1 / s) and this w / s may differ there)."""
    edge = np.abs(2 * ratio - np.rint(2 * ratio)) < 2e-4
    return bool(np.all((q == np.clip(rounding(ratio), lo, hi)) | edge))


def _f16(v) -> str:
    return f"{float(v):.6g} (fp16 bits 0x{int(np.float16(v).view(np.uint16)):04x})"


def _check_types(name, got, dtypes):
    require(isinstance(got, tuple) and len(got) == len(dtypes),
            f"{name} returns {type(got).__name__}, expected a tuple of {len(dtypes)} arrays")
    for i, (a, dt) in enumerate(zip(got, dtypes)):
        require(isinstance(a, np.ndarray) and a.dtype == dt,
                f"{name}: result {i} is {getattr(a, 'dtype', type(a).__name__)}, expected "
                f"{np.dtype(dt).name}")


def check_quantize_int8(ws: Workspace) -> None:
    Q = ws.module("stage1_cpu/quant.py")
    g = _groups(8)
    got = Q._quantize_int8(g.copy())
    _check_types("_quantize_int8", got, (np.int8, np.float16))
    q, s = got
    want_s = (np.abs(g).max(axis=-1) / 127.0).astype(np.float16)                     # [R, G]
    assert_equal("int8 scale", s, want_s, axes_names=("row", "group"), show=_f16,
                 hint="s = the group's largest |w| / 127, stored as fp16",
                 mistakes=[("a scale from the largest w, not the largest |w|: a group whose "
                            "largest magnitude is negative clips",
                            (g.max(axis=-1) / 127.0).astype(np.float16))])
    sf = want_s.astype(np.float32)[:, :, None]
    ratio = np.divide(g, sf, out=np.zeros_like(g), where=sf > 0)
    exact = np.abs(g).max(axis=-1, keepdims=True) / 127.0
    if not _rounds_as(q, ratio, np.rint, -127, 127):                 # wrong: which mistake is it?
        exact_ratio = np.divide(g, exact, out=np.zeros_like(g), where=exact > 0)
        if _rounds_as(q, exact_ratio, np.rint, -127, 127):
            raise CheckFailed("int8 q: q was rounded against the exact scale: divide by the stored "
                              "fp16 scale s, the one the matmul multiplies back")
        if _rounds_as(q, ratio, np.trunc, -127, 127):
            raise CheckFailed("int8 q: w / s was cut toward zero (astype alone truncates): round "
                              "to the nearest integer, np.rint, first")
    want_q = np.clip(np.rint(ratio), -127, 127)
    bad = (q.astype(np.int64) != want_q) & ~(_near_half(ratio) & (np.abs(q - want_q) == 1))
    assert_equal("int8 q", np.where(bad, q, want_q).astype(np.int64), want_q.astype(np.int64),
                 axes_names=("row", "group", "index"),
                 hint="q = round(w / s) with the stored fp16 scale, clipped to [-127, 127]; an "
                      "all-zero group is 0")


def check_quantize_int4(ws: Workspace) -> None:
    Q = ws.module("stage1_cpu/quant.py")
    g = _groups(9)
    got = Q._quantize_int4(g.copy())
    _check_types("_quantize_int4", got, (np.uint8, np.float16, np.float16))
    packed, s, m = got
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    want_s, want_m = ((hi - lo) / 15.0).astype(np.float16), lo.astype(np.float16)
    assert_equal("int4 scale", s, want_s, axes_names=("row", "group"), show=_f16,
                 hint="s = (max - min) / 15 of the group, stored as fp16",
                 mistakes=[("4 bits hold 16 levels, 15 steps apart: s = (max - min) / 15",
                            ((hi - lo) / 16.0).astype(np.float16))])
    assert_equal("int4 min", m, want_m, axes_names=("row", "group"), show=_f16,
                 hint="m = the group's minimum, stored as fp16")
    sf = want_s.astype(np.float32)[:, :, None]
    ratio = np.divide(g - want_m.astype(np.float32)[:, :, None], sf,
                      out=np.zeros_like(g), where=sf > 0)
    want_q = np.clip(np.rint(ratio), 0, 15).astype(np.int64)             # [R, G, gs]
    require(packed.shape == (g.shape[0], g.shape[1] // 2, g.shape[2]),
            f"int4 packed: shape {list(packed.shape)}, expected "
            f"{[g.shape[0], g.shape[1] // 2, g.shape[2]]} (two groups per byte)")
    lo_n, hi_n = (packed & 15).astype(np.int64), (packed >> 4).astype(np.int64)   # [R, G/2, gs]
    def nibbles_hold(low, high) -> bool:          # the low and high nibbles round these ratios
        return _rounds_as(lo_n, low, np.rint, 0, 15) and _rounds_as(hi_n, high, np.rint, 0, 15)
    even, odd = ratio[:, 0::2], ratio[:, 1::2]
    if not nibbles_hold(even, odd) and nibbles_hold(odd, even):
        raise CheckFailed("int4 packed: the nibbles are swapped: group 2p goes in the low nibble "
                          "(q & 15), group 2p+1 in the high one (q >> 4)")
    for half, nib, groups in (("low", lo_n, "2p"), ("high", hi_n, "2p+1")):
        want = want_q[:, 0::2] if half == "low" else want_q[:, 1::2]
        r = ratio[:, 0::2] if half == "low" else ratio[:, 1::2]
        bad = (nib != want) & ~(_near_half(r) & (np.abs(nib - want) == 1))
        assert_equal(f"int4 packed, the {half} nibbles", np.where(bad, nib, want), want,
                     axes_names=("row", "pair", "index"),
                     hint=f"byte j of pair p holds weight j of group {groups} in its {half} "
                          "nibble; q = round((w - m) / s) in [0, 15]")


def _matvec_case(fmt: str, seed: int):
    r = _rng(seed)
    O, K, gs = 37, 100, 32                              # 100 inputs: groups padded with zeros
    w = r.normal(0, 0.2, (O, K)).astype(np.float32)
    # one group per row much larger: its scale matters
    w[:, 64:96] *= 8.0
    W = quant.quantize(w, fmt, gs)
    x = np.zeros((3, W.padded_in), dtype=np.float32)
    x[:, :K] = r.normal(0, 1, (3, K))
    want = x[:, :K].astype(np.float64) @ W.dequantize().astype(np.float64).T     # [T, O]
    return W, x, want


def check_matvec_int8(ws: Workspace) -> None:
    Mm = ws.module("stage1_cpu/matmul.py")
    W, x, want = _matvec_case("int8", 10)
    gs = W.group_size
    q = W.data.astype(np.float64)                                          # [O, G, gs]
    s = W.scales.view(np.float16).astype(np.float64)                       # [O, G], fp16 bits
    for T in (1, 3):
        x3 = x[:T].reshape(T, -1, gs).astype(np.float64)                   # [T, G, gs]
        dots = np.einsum("ogj,tgj->tog", q, x3)                            # [T, O, G]
        mistakes = [("every group used group 0's scale: group g has its own scale s[r, g]",
                     (dots * s[None, :, :1]).sum(-1)),
                    ("no scale applied: multiply each group's integer dot product by s[r, g]",
                     dots.sum(-1)),
                    ("every group read group 0's activations: group g's weights multiply "
                     "x3[t, g, :]", (np.einsum("ogj,tj->tog", q, x3[:, 0]) * s[None]).sum(-1))]
        out = np.full((T, W.out_features), np.nan, dtype=np.float32)
        Mm.matmul_int8(x[:T].reshape(T, -1, gs), W.data, W.scales, out)
        assert_close(f"matmul_int8, {T} token(s)", out, want[:T], atol=1e-4, rtol=1e-4,
                     mistakes=mistakes, axes_names=("token", "row"),
                     hint="out[t, r] = sum over groups g of s[r, g] * sum_j q[r, g, j] x[t, g, j]")


def _int4_terms(W, x4: np.ndarray) -> dict[str, np.ndarray]:
    """The terms of pair p of an int4 row, [T, O, P] each, in float64: the low nibbles (group
    2p) and the high ones (group 2p+1) times their inputs and scales, each group's minimum
    times the sum of its inputs; then the same with the other group's inputs (mistakes')."""
    lo, hi = (W.data & 15).astype(np.float64), (W.data >> 4).astype(np.float64)   # [O, P, gs]
    s, m = (a.view(np.float16).astype(np.float64) for a in (W.scales, W.mins))    # [O, G]
    s_lo, s_hi, m_lo, m_hi = s[None, :, 0::2], s[None, :, 1::2], m[None, :, 0::2], m[None, :, 1::2]
    xsum = x4.sum(-1)[:, None]                                                    # [T, 1, P, 2]
    dot = lambda nib, half: np.einsum("opj,tpj->top", nib, x4[:, :, half])  # noqa: E731
    return dict(lo=dot(lo, 0) * s_lo, hi=dot(hi, 1) * s_hi,
                m_lo=m_lo * xsum[..., 0], m_hi=m_hi * xsum[..., 1],
                lo_x_hi=dot(lo, 1) * s_lo, hi_x_lo=dot(hi, 0) * s_hi, m_lo_x_hi=m_lo * xsum[..., 1])


def check_matvec_int4(ws: Workspace) -> None:
    Mm = ws.module("stage1_cpu/matmul.py")
    W, x, want = _matvec_case("int4", 11)
    gs = W.group_size
    for T in (1, 3):
        a = _int4_terms(W, x[:T].reshape(T, -1, 2, gs).astype(np.float64))
        sums = lambda *names: sum(a[n] for n in names).sum(-1)  # noqa: E731
        mistakes = [("each group adds its minimum m times the sum of its inputs, m[r, g] * xsum",
                     sums("lo", "hi", "m_hi")),
                    ("each group adds its minimum m times the sum of its inputs, m[r, g] * xsum",
                     sums("lo", "hi")),
                    ("the low nibble is group 2p: it multiplies x4[t, p, 0], the high one "
                     "x4[t, p, 1]", sums("lo_x_hi", "hi_x_lo", "m_lo", "m_hi")),
                    ("group 2p's m multiplies the sum of its own group's inputs, xsum[t, p, 0]",
                     sums("lo", "hi", "m_lo_x_hi", "m_hi"))]
        out = np.full((T, W.out_features), np.nan, dtype=np.float32)
        Mm.matmul_int4(x[:T].reshape(T, -1, 2, gs), W.data, W.scales, W.mins, out)
        assert_close(f"matmul_int4, {T} token(s)", out, want[:T], atol=1e-4, rtol=1e-4,
                     axes_names=("token", "row"), mistakes=mistakes,
                     hint="W = nibble * s + m per group, so a group adds s * sum(nibble x) + m * "
                          "sum(x); the low nibble is group 2p, the high one group 2p+1")


# ---------------------------------------------------------------------------
# 1.12 the penalties, 1.13 top-k / top-p / min-p (common/sampling.py)
# ---------------------------------------------------------------------------

def _penalised(logits, rep, presence, frequency, prompt, output, rep_negative=True,
               presence_once=True):
    """The definition (vLLM's, as common/sampling.py's docstring says): repetition over prompt
    and output (divides a positive logit, multiplies a negative one), presence once and
    frequency per occurrence over the output only. rep_negative False: a negative logit is
    divided too; presence_once False: presence counts every occurrence (two mistakes)."""
    out = logits.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 or not rep_negative else out[t] * rep
    for t in set(output):
        out[t] -= (presence + frequency) * output.count(t) if not presence_once else \
            presence + frequency * output.count(t)
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
        params = S.SamplingParams(repetition_penalty=rep, presence_penalty=pres,
                                  frequency_penalty=freq)
        before = logits.copy()
        got = S.apply_penalties(logits, params, list(prompt), list(out_ids))
        require(np.array_equal(logits, before), f"apply_penalties, {name}: it changed the caller's "
                                                "logits (return a penalised copy)")
        args = (logits, rep, pres, freq, prompt, out_ids)
        mistakes = [("presence counts once per distinct token of the output; frequency per "
                     "occurrence", _penalised(*args, presence_once=False)),
                    ("a negative logit is multiplied by the repetition penalty, not divided: both "
                     "move down", _penalised(*args, rep_negative=False)),
                    ("the repetition penalty covers the prompt's tokens too, not only the output's",
                     _penalised(logits, rep, pres, freq, [], out_ids))]
        assert_close(f"apply_penalties, {name}", got, _penalised(*args), mistakes=mistakes,
                     atol=1e-5, rtol=1e-5, axes_names=("token id",))


def _filtered(logits, temperature, top_k, top_p, min_p, mistake: str = ""):
    """The definition: logits / temperature; top-k keeps the k largest (ties at the k-th value
    all stay); top-p keeps, in order of probability, every token whose preceding mass is below
    top_p (the most likely always stays); min-p drops p < min_p * p(most likely). Probabilities
    are those after top-k, in float64. Dropped tokens are -inf. mistake: "mass" (top-p keeps a
    token whose mass with its own stays below top_p), "equal" (and one whose preceding mass
    equals top_p), "absolute" (min-p drops p < min_p)."""
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
        cuts = {"mass": before + p[order] >= top_p, "equal": before > top_p}
        cut = cuts.get(mistake, before >= top_p)
        keep[order[cut]] = False
    if min_p > 0.0:
        keep &= p >= min_p * (1.0 if mistake == "absolute" else p.max())
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
                         ("top_k 3 with ties at the 3rd value (all tied tokens stay)",
                          ties, dict(top_k=3)),
                         ("top_p 0.8", logits, dict(top_p=0.8)),
                         ("top_p 0.76: the token whose mass crosses it stays",
                          halves, dict(top_p=0.76)),
                         ("top_p 0.5 over four equal tokens: the third's preceding mass is 0.5 "
                          "exactly, it goes",
                          np.zeros(4, dtype=np.float32), dict(top_p=0.5)),
                         ("min_p 0.1 at temperature 1.5", logits, dict(temperature=1.5, min_p=0.1)),
                         ("top_k 10, top_p 0.9, min_p 0.05", logits,
                          dict(top_k=10, top_p=0.9, min_p=0.05)),
                         ("top_k 100 (more than the vocabulary: no effect)",
                          logits, dict(top_k=100))):
        kw = dict(dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), **kw)
        got = np.asarray(S.filter_logits(lg.copy(), S.SamplingParams(**kw)), dtype=np.float64)
        want = _filtered(lg, kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"])
        opts = ", ".join(f"{k_}={v}" for k_, v in kw.items())
        require(got.shape == want.shape,
                f"filter_logits, {name}: shape {list(got.shape)}, expected {list(want.shape)}")
        kept_got, kept_want = np.isfinite(got), np.isfinite(want)
        mistakes = {"mass": "the token whose mass takes the kept mass past top_p stays: keep every "
                            "token whose preceding mass is below top_p",
                    "equal": "a token whose preceding mass equals top_p goes: keep the mass "
                             "strictly below",
                    "absolute": "min_p is relative: drop p < min_p times the most likely token's p"}
        named = next((words for mistake, words in mistakes.items() if np.array_equal(
            kept_got, np.isfinite(_filtered(lg, *kw.values(), mistake=mistake)))), "")
        if (kept_got != kept_want).any():
            t = int(np.argmax(kept_got != kept_want))
            raise CheckFailed(f"filter_logits, {name} ({opts}): token {t} (logit "
                              f"{float(lg[t]):.4g}) should be "
                              f"{'kept' if kept_want[t] else 'dropped'}, got "
                              f"{'kept' if kept_got[t] else 'dropped'}; {int(kept_want.sum())} "
                              f"tokens should stay, {int(kept_got.sum())} "
                              f"did{f' ({named})' if named else ''}")
        assert_close(f"filter_logits, {name}: the kept logits", np.where(kept_want, got, 0),
                     np.where(kept_want, want, 0),
                     atol=1e-5, rtol=1e-5, axes_names=("token id",),
                     hint="kept logits are logits / temperature")


# ---------------------------------------------------------------------------
# 1.14 the acceptance rule of speculative sampling (stage1_cpu/speculative.py)
# ---------------------------------------------------------------------------

# a right answer fails a chi-square case for one seed in a million (the seeds are fixed)
P_FAIL = 1e-6


def chi_square_p(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's chi-square test of counts [cells] against the distribution expected [cells]:
    each cell expected 5 times or more on its own, the rarer ones pooled (into the smallest cell
    when the pool itself is expected under 5 times) -> (p-value, degrees of freedom)."""
    # here, as in tiny_model: only the checks that count draws need its incomplete gamma
    import torch
    counts = np.asarray(counts, dtype=np.float64).ravel()
    e = counts.sum() * np.asarray(expected).ravel()
    big, rare = e >= 5, (e < 5) & (e > 0)
    obs, exp = list(counts[big]), list(e[big])
    if e[rare].sum() >= 5:
        obs, exp = obs + [counts[rare].sum()], exp + [e[rare].sum()]
    elif rare.any():
        j = int(np.argmin(exp))
        obs[j], exp[j] = obs[j] + counts[rare].sum(), exp[j] + e[rare].sum()
    x = float(sum((o - m) ** 2 / m for o, m in zip(obs, exp)))
    df = len(obs) - 1
    sf = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                 torch.tensor(x / 2, dtype=torch.float64))
    return float(sf), df


def _speculate(accept, P: np.ndarray, Q: np.ndarray, n: int, seed: int) -> tuple[np.ndarray, int]:
    """n runs of speculative sampling on a toy model over V tokens whose next-token distribution
    depends on the previous token only: P [V+1, V] the model's (row V: after the prompt), Q the
    draft's. Each run drafts 3 tokens from Q's chain, checks them in order with accept(p, q, x,
    rng), and after a rejection draws plainly from P -> (counts of the first 3 tokens [V, V, V], how
    many runs kept their first draft)."""
    V, r = P.shape[1], _rng(seed)
    # a draw from each row by the inverse cdf
    draw = lambda rows, u: (u[:, None] > np.cumsum(rows, -1)[:, :-1]).sum(-1)  # noqa: E731
    drafts = [draw(Q[np.full(n, V)], r.random(n))]
    # every run's 3 drafts at once, each from q after the last
    for _ in range(2):
        drafts.append(draw(Q[drafts[-1]], r.random(n)))
    counts, kept_first = np.zeros((V, V, V), dtype=np.int64), 0
    for run in range(n):
        out, prev = [], V
        for x in (int(d[run]) for d in drafts):
            ok, y = accept(P[prev].copy(), Q[prev].copy(), x, r)
            require(0 <= int(y) < V and (not ok or int(y) == x),
                    f"accept_draft returned ({ok!r}, {y!r}) for draft {x}: (True, x) or (False, a "
                    f"token id in 0..{V - 1})")
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
    for name, Q, seed in (("a draft drawn from another model's distribution q",
                           soft(r.normal(0, 1.2, (V + 1, V))), 15),
                          ("a draft picked without chance (q one-hot, as prompt lookup's)",
                           np.eye(V)[r.integers(0, V, V + 1)], 16)):
        counts, kept = _speculate(S.accept_draft, P, Q, N, seed)
        # p(a) p(b | a) p(c | b)
        joint = P[V][:, None, None] * P[:V][:, :, None] * P[:V][None, :, :]
        p_value, df = chi_square_p(counts, joint)
        # the rule's acceptance: sum min(p, q)
        want = np.minimum(P[V], Q[V]).sum()
        got, sd = kept / N, np.sqrt(want * (1 - want) / N)
        wrong = (f"{name}: the first three tokens of {N} runs do not follow the model's "
                 f"distribution (chi-square p = {p_value:.1e} over {df + 1} cells)")
        require(p_value > P_FAIL or abs(got - want) < 5.3 * sd + 1e-12,
                f"{wrong}, and {got:.1%} of first drafts were accepted where the rule accepts "
                f"{want:.1%}: keep a draft x with probability min(1, p[x] / q[x])")
        require(p_value > P_FAIL, f"{wrong}, though drafts are accepted as often as they "
                                  "should be: replace a rejected draft by a draw from the "
                                  "residual max(0, p - q), normalised")
        require(abs(got - want) < 5.3 * sd + 1e-12,
                f"{name}: the tokens follow the model's distribution, but {got:.1%} of first "
                f"drafts were accepted where min(1, p[x] / q[x]) accepts {want:.1%}: accept by "
                "that probability, not by another test")


S1 = "docs/stage1.md"
KERNELS = f"{S1}#7-the-kernels"
MODEL = f"{S1}#3-modelpy-the-forward-pass"
MOE = f"{S1}#3b-mixture-of-experts-routing-grouping-bytes-per-token"
QUANT = f"{S1}#6-quantpy-fewer-bytes-per-token"
SAMPLING = "docs/chat.md#sampling-defaults"

EXERCISES: list[Exercise] = [
    Exercise("1.1", "RMSNorm of one row", MODEL, "easy", "stage1_cpu/norms.py",
             check=check_rmsnorm),
    Exercise("1.2", "RoPE, rotate-half, of one head", MODEL, "easy",
             "stage1_cpu/kernels.py", check=check_rope),
    Exercise("1.3", "a numerically safe softmax (inside attention)", KERNELS, "easy",
             "stage1_cpu/kernels.py", check=check_softmax),
    Exercise("1.4", "causal GQA attention over the KV cache", MODEL, "medium",
             "stage1_cpu/kernels.py", check=check_attention),
    Exercise("1.5", "KV reuse across chat turns", f"{S1}#2-enginepy-prefill-then-decode", "easy",
             "stage1_cpu/engine.py", check=check_kv_reuse),
    Exercise("1.6", "MoE top-k routing with renormalisation", MOE, "medium",
             "stage1_cpu/kernels.py", check=check_route),
    Exercise("1.7", "grouping a prefill's tokens per expert", MOE, "medium", "stage1_cpu/model.py",
             check=check_experts),
    Exercise("1.8", "int8 group quantization", QUANT, "easy", "stage1_cpu/quant.py",
             check=check_quantize_int8),
    Exercise("1.9", "the fused int8 dequantize-matvec row", QUANT, "medium", "stage1_cpu/matmul.py",
             check=check_matvec_int8),
    Exercise("1.10", "int4 quantization and packing", QUANT, "medium", "stage1_cpu/quant.py",
             check=check_quantize_int4),
    Exercise("1.11", "the fused int4 dequantize-matvec row", QUANT, "hard", "stage1_cpu/matmul.py",
             check=check_matvec_int4),
    Exercise("1.12", "repetition, presence and frequency penalties", SAMPLING, "easy",
             "common/sampling.py", check=check_penalties),
    Exercise("1.13", "top-k, top-p and min-p filters", SAMPLING, "medium", "common/sampling.py",
             check=check_filters),
    Exercise("1.14", "the acceptance rule of speculative sampling",
             f"{S1}#15-speculativepy-several-tokens-per-step", "medium",
             "stage1_cpu/speculative.py", check=check_acceptance),
]
