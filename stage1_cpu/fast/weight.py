"""FastWeight: a quant.Weight that rounds its activations where the CPU pays for it.

Changed from the core (quant.Weight): two fields say how the activations are
rounded before they meet the weights, and matmul() routes those cases to the
fast kernels (fast/kernels.py); every other case is the core's code, unchanged.

- bf16 weights at decode: four rows per pass, in whole blocks of rows (blocks.py).

- decode_act="int8" (int8 / int4 weights, cpu.INT8): decode rounds the
  activations to int8 per group of gs values (x ~ xq * xs, xs = max|x| / 127)
  and multiplies integers (kernels.matmul_int8_q8 / matmul_int4_q8). llama.cpp
  does the same for its Q8_0 / Q4_0 weights.
- decode_act="int16" (int8 weights, cpu.INT8): the same with 15-bit
  activations (xs = max|x| / 32767), for the lm_head: almost exact, about as
  fast as int8 there, where memory is the limit (kernels.matmul_int8_q16).
- prefill_act="bf16" (bf16 weights, and int8 / int4 ones when asked for; cpu.BF16):
  prefill rounds the activations to bf16 and runs a vdpbf16ps GEMM
  (kernels.matmul_bf16_prefill) instead of fp32 tiles through sgemm: twice the FLOP/s.
  int8 / int4 weights are dequantized to bf16 for it on every call, which is why
  --activations auto gives them the integer GEMM below instead (as fast per cycle on
  such CPUs, more exact, nothing to dequantize).

- prefill_act="int8" (int8 / int4 weights, cpu.INT8; --activations int8): prefill
  rounds the activations as decode does and runs gemm.py's integer GEMM with register
  tiles, on 64 rows at a time repacked as it goes, instead of fp32 tiles through sgemm.
- prefill_act="int16" (int8 / int4 weights, cpu.INT8; --activations auto): the same
  GEMM with the activations rounded to int16 (xs = max|x| / 32767), almost exact: the
  AVX2 int8 tile widens both operands to int16 for vpmaddwd anyway, so there it costs
  int8 weights nothing; int4 weights go through that tile too (vpmaddwd's rate, half
  vpmaddubsw's; on VNNI vpdpwssd's, half vpdpbusd's). int8 rounding over a whole
  prompt flips the default model's first answer.

The numpy twin (matmul_ref) rounds the same things the same way, so the kernels
are still checked exactly against a definition; tests/test_quant_quality.py
states what the rounding costs in perplexity.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from . import blocks, cpu, gemm
from . import kernels as fk
from . import simd
from ..quant import PREFILL_MIN_T, Weight, bf16_bits_to_f32, f32_to_bf16_bits, quantize

BF16_ROWS = 8192    # rows of an int8 / int4 matrix turned into bf16 at a time (prefill_act="bf16")


@dataclass(eq=False)
class FastWeight(Weight):
    decode_act: str = "fp32"            # T < PREFILL_MIN_T: fp32 | int8 (int8 / int4 weights) | int16 (int8)
    prefill_act: str = "fp32"           # T >= PREFILL_MIN_T: fp32 | bf16 (bf16 / int8 / int4) | int8 | int16
    #                                     (int8 / int4)

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x [T, in] f32 -> x @ W.T [T, out] f32, the activations rounded as the fields say."""
        T = x.shape[0]
        if T >= PREFILL_MIN_T and self.prefill_act == "bf16":
            return self._matmul_bf16(self._pad(self._check(x)))
        if T >= PREFILL_MIN_T and self.prefill_act in ("int8", "int16"):
            return self._matmul_int8_prefill(self._pad(self._check(x)))
        if T < PREFILL_MIN_T and self.fmt == "bf16":                     # four rows per pass (blocks.py)
            x = self._check(x)
            out = np.empty((T, self.out_features), dtype=np.float32)
            blocks.matmul_bf16(x, self.data, out)
            return out
        if T >= PREFILL_MIN_T or self.decode_act == "fp32":
            return super().matmul(x)                                     # the core's kernels
        x = self._pad(self._check(x))                                    # [T, Kp]
        out = np.empty((T, self.out_features), dtype=np.float32)
        x3 = x.reshape(T, -1, self.group_size)                           # [T, G, gs]
        gsk = simd.chunks(self.group_size)                               # compiled for this group size
        if self.decode_act == "int16":
            x16, xs = fk.quantize_activations16(x3)                      # [T, G, gs], [T, G]
            fk.matmul_int8_q16(x16, xs, self.data, self.scales, out, gsk)
        else:
            xq, xa, xs, xsum = fk.quantize_activations(x3)               # [T, G, gs], [T, G]
            if self.fmt == "int8":
                fk.matmul_int8_q8(xq, xa, xs, self.data, self.scales, out, gsk)
            else:
                fk.matmul_int4_q8(xq, xs, xsum, self.data, self.scales, self.mins, out, gsk)
        return out

    def _matmul_bf16(self, x: np.ndarray) -> np.ndarray:
        """Prefill on simd.py's bf16 GEMM: x [T, Kp] rounded to bf16 pairs once; int8 /
        int4 weights dequantized to bf16 BF16_ROWS rows at a time (8192 x 1024: 16 MB)."""
        T, O = x.shape[0], self.out_features
        xb = fk.bf16_pairs(x, simd.TOKENS)                                # [Tp, Kp/2] bf16 pairs
        out = np.empty((T, O), dtype=np.float32)
        if self.fmt == "bf16":
            fk.matmul_bf16_prefill(xb, self.data.view(np.uint32), out)
            return out
        for r0 in range(0, O, BF16_ROWS):
            r1 = min(O, r0 + BF16_ROWS)
            w2 = np.empty((r1 - r0, self.padded_in // 2), dtype=np.uint32)  # [rows, Kp/2] bf16 pairs
            if self.fmt == "int8":
                fk.bf16_pairs_int8(self.data[r0:r1], self.scales[r0:r1], w2)
            else:
                fk.bf16_pairs_int4(self.data[r0:r1], self.scales[r0:r1], self.mins[r0:r1], w2)
            fk.matmul_bf16_prefill(xb, w2, out[:, r0:r1])
        return out

    def _matmul_int8_prefill(self, x: np.ndarray) -> np.ndarray:
        """Prefill on gemm.py's integer GEMM: x [T, Kp] rounded per token and group to int8
        as at decode (prefill_act int8) or to int16 (int16), integer dot products in register
        tiles on 64 rows at a time, repacked by each thread as it takes them (no copy of the
        weights is kept). Group sizes that are not a multiple of 32, or past 256 (a group's
        int32 sum), take the core's tile + sgemm."""
        if self.group_size % gemm.CHUNK or self.group_size > 256:
            return super().matmul(x)
        return gemm.gemm(self, x, self.prefill_act)

    def matmul_ref(self, x: np.ndarray) -> np.ndarray:
        """The numpy twin: round x (and W, for bf16 prefill) as matmul does, then multiply."""
        x = self._check(x)
        w = self.dequantize()
        if self.decode_act != "fp32" and x.shape[0] < PREFILL_MIN_T:    # decode rounds x to int8 / int16
            qmax = 127 if self.decode_act == "int8" else 32767
            x = quantize_activations(self._pad(x), self.group_size, qmax)[:, : self.in_features]
        if self.prefill_act in ("int8", "int16") and x.shape[0] >= PREFILL_MIN_T:  # the integer GEMM's rounding
            qmax = 127 if self.prefill_act == "int8" else 32767
            x = quantize_activations(self._pad(x), self.group_size, qmax)[:, : self.in_features]
        if self.prefill_act == "bf16" and x.shape[0] >= PREFILL_MIN_T:  # prefill rounds x and W to bf16
            x, w = bf16_bits_to_f32(f32_to_bf16_bits(x)), bf16_bits_to_f32(f32_to_bf16_bits(w))
        return (x @ w.T).astype(np.float32)


def quantize_activations(x: np.ndarray, gs: int, qmax: int = 127) -> np.ndarray:
    """The twin of kernels.quantize_activations (qmax 127) and quantize_activations16
    (qmax 32767), as the kernels see it: x [T, Kp] f32 -> xq * xs [T, Kp], x rounded
    per group of gs to integers in [-qmax, qmax] with xs = max|x| / qmax."""
    g = x.reshape(x.shape[0], -1, gs)                                     # [T, G, gs]
    scale = np.abs(g).max(axis=-1, keepdims=True) / np.float32(qmax)      # [T, G, 1]
    inv = np.divide(np.float32(1.0), scale, out=np.zeros_like(scale), where=scale > 0)
    with np.errstate(invalid="ignore"):                                   # inf * 0 is meant here
        poison = (g * np.float32(0.0)).sum(axis=-1, keepdims=True)        # NaN where x has NaN / inf
        return (np.rint(np.nan_to_num(g * inv)) * (scale + poison)).reshape(x.shape).astype(np.float32)


def fast_quantize(w: np.ndarray, fmt: str, group_size: int = 32,
                  decode_act: str = "fp32", prefill_act: str = "fp32") -> FastWeight:
    """quant.quantize, then the activation rounding asked for (checked against this CPU)."""
    check_act(decode_act, prefill_act, fmt, w.in_features if isinstance(w, Weight) else np.shape(w)[-1])
    return as_fast(quantize(w, fmt, group_size), decode_act, prefill_act)


def as_fast(w: Weight, decode_act: str = "fp32", prefill_act: str = "fp32") -> FastWeight:
    """The same stored arrays (no copy) as a FastWeight."""
    fields = {f.name: getattr(w, f.name) for f in dataclasses.fields(Weight)}
    return FastWeight(**fields, decode_act=decode_act, prefill_act=prefill_act)


def check_act(decode_act: str, prefill_act: str, fmt: str, K: int) -> None:
    if decode_act not in ("fp32", "int8", "int16") or prefill_act not in ("fp32", "bf16", "int8", "int16"):
        raise ValueError(f"decode activations are fp32, int8 or int16, prefill ones fp32, bf16, int8 or int16; "
                         f"got {decode_act!r}, {prefill_act!r}")
    here = f"here: {cpu.INT8 or 'none'}"
    if decode_act == "int8" and not (fmt in ("int8", "int4") and cpu.INT8):
        raise ValueError(f"int8 activations are not available for {fmt} weights on this CPU: they need "
                         f"int8 / int4 weights and an int8 dot product (VNNI, AVX2 or ARM dotprod; {here}); use fp32")
    if decode_act == "int16" and not (fmt == "int8" and cpu.INT8):
        raise ValueError(f"int16 activations are not available for {fmt} weights on this CPU: they need "
                         f"int8 weights and an int8 dot product (VNNI, AVX2 or ARM dotprod; {here}); use fp32")
    if prefill_act in ("int8", "int16") and not (fmt in ("int8", "int4") and cpu.INT8):   # the integer GEMM
        raise ValueError(f"{prefill_act} prefill activations are not available for {fmt} weights on this CPU: they "
                         f"need int8 / int4 weights and an int8 dot product (VNNI, AVX2 or ARM dotprod; {here}); "
                         "use fp32")
    if prefill_act == "bf16" and not (cpu.BF16 and (fmt in ("int8", "int4") or (fmt == "bf16" and K % 2 == 0))):
        raise ValueError(f"bf16 activations are not available for {fmt} weights [*, {K}] on this CPU: "
                         f"they need bf16 / int8 / int4 weights, an even in_features (bf16) and "
                         f"AVX-512 BF16 (here: {'yes' if cpu.BF16 else 'no'}); use fp32")
