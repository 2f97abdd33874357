"""FastWeight: a quant.Weight that rounds its activations where the CPU pays for it.

Changed from the core (quant.Weight): two fields say how the activations are
rounded before they meet the weights, and matmul() routes those cases to the
fast kernels (fast/kernels.py); every other case is the core's code, unchanged.

- bf16 weights at decode: four rows per pass, in whole blocks of rows (blocks.py).

- decode_act="int8" (int8 / int4 weights, cpu.INT8): decode rounds the
  activations to int8 per group of gs values (x ~ xq * xs, xs = max|x| / 127)
  and multiplies integers (kernels.matmul_tiled, on tiles.py's register tiles).
  llama.cpp does the same for its Q8_0 / Q4_0 weights. Such a weight is stored in
  8-row tiles (tiles.to_tiles, once, at load: `seg` says so), which every path
  reads: decode, a step of a few tokens, prefill, and the rows of an embedding.
- decode_act="int16" (int8 weights, cpu.INT8): the same with 15-bit
  activations (xs = max|x| / 32767), for the lm_head: almost exact, at half
  the multiply-adds per instruction, where memory is the limit.
- prefill_act="bf16" (bf16 weights; cpu.BF16): prefill rounds the activations
  to bf16 and runs a vdpbf16ps GEMM (kernels.matmul_bf16_prefill) instead of
  fp32 tiles through sgemm: twice the FLOP/s.

- prefill_act="int8" (int8 / int4 weights, cpu.INT8; --activations int8): prefill
  rounds the activations as decode does and runs gemm.py's integer GEMM on the
  stored tiles, instead of fp32 tiles through sgemm.
- prefill_act="int16" (int8 / int4 weights, cpu.INT8; --activations auto): the same
  GEMM with the activations rounded to int16 (xs = max|x| / 32767), almost exact
  (vpdpwssd's rate, half vpdpbusd's). int8 rounding over a whole prompt flips the
  default model's first answer.

The numpy twin (matmul_ref) rounds the same things the same way, so the kernels
are still checked exactly against a definition; tests/test_quant_quality.py
states what the rounding costs in perplexity.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numba
import numpy as np

from . import blocks, cpu, gemm, tiles
from . import kernels as fk
from . import simd
from ..quant import PREFILL_MIN_T, Weight, bf16_bits_to_f32, f32_to_bf16_bits, quantize

BF16_ROWS = 8192    # rows of an int8 / int4 matrix turned into bf16 at a time (prefill_act="bf16")


@dataclass(eq=False, repr=False)       # Weight's short repr, not every array
class FastWeight(Weight):
    # T < PREFILL_MIN_T: fp32 | int8 (int8 / int4 weights) | int16 (int8)
    decode_act: str = "fp32"
    # T >= PREFILL_MIN_T: fp32 | bf16 (bf16 / int8 / int4) | int8 | int16 (int8 / int4)
    prefill_act: str = "fp32"
    # 0: stored as the core stores it; else in 8-row tiles (tiles.py), each segment of seg rows
    # (one expert of a stack) padded to 8
    seg: int = 0

    @property
    def tiled(self) -> bool:
        return self.seg > 0

    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x [T, in] f32 -> x @ W.T [T, out] f32, the activations rounded as the fields say."""
        T = x.shape[0]
        if T >= PREFILL_MIN_T and self.prefill_act == "bf16":
            return self._matmul_bf16(self._pad(self._check(x)))
        if T >= PREFILL_MIN_T and self.prefill_act in ("int8", "int16"):
            return self._rows_out(gemm.gemm(self, self._pad(self._check(x)), self.prefill_act))
        # four rows per pass (blocks.py)
        if T < PREFILL_MIN_T and self.fmt == "bf16":
            x = self._check(x)
            out = np.empty((T, self.out_features), dtype=np.float32)
            blocks.matmul_bf16(x, self.data, out)
            return out
        if T >= PREFILL_MIN_T or self.decode_act == "fp32":
            return super().matmul(x)                                     # the core's kernels
        x3 = self._pad(self._check(x)).reshape(T, -1, self.group_size)  # [T, G, gs]
        out = np.empty((T, self.data.shape[0] * tiles.ROWS), dtype=np.float32)   # [T, 8 V]
        if self.decode_act == "int16":
            x16, xs, xsum = fk.quantize_activations16(x3)               # [T, G, gs], [T, G]
            xq, xcorr = x16.reshape(T, -1), np.zeros_like(xs, dtype=np.int32)
        else:
            xq, xcorr, xs, xsum = fk.quantize_activations(x3)
            xq = xq.reshape(T, -1)
        # the kind: int8/int4 x int8/int16
        k = [None] * 4
        k[2 * (self.fmt == "int4") + (self.decode_act == "int16")] = True
        mins = self.scales if self.mins is None else self.mins
        fk.matmul_tiled(xq, xs, xcorr, xsum, self.data, self.scales, mins, out,
                        numba.get_num_threads(), *k)
        return self._rows_out(out)

    def _rows_out(self, out: np.ndarray) -> np.ndarray:
        """[T, tiled rows] -> [T, out_features]: the padding of each segment left out."""
        if not self.tiled or out.shape[1] == self.out_features:
            return out
        if self.seg >= self.out_features:
            return np.ascontiguousarray(out[:, :self.out_features])
        return out[:, tiles.tiled_row(np.arange(self.out_features), self.seg)]

    def part(self, r0: int, r1: int) -> "FastWeight":
        """Rows r0..r1-1, views, no copy: in tiles, whole segments (one expert of a stack)."""
        if not self.tiled:
            return super().part(r0, r1)
        if r0 % self.seg or (r1 - r0) % self.seg and r1 != self.out_features:
            raise ValueError(f"rows {r0}..{r1} of a matrix in tiles of {self.seg}-row segments")
        b0, b1 = (tiles.tiled_row(r0, self.seg) // tiles.ROWS,
                  -(-tiles.tiled_row(r1 - 1, self.seg) // tiles.ROWS))
        b1 = max(b1, tiles.tiled_row(r1 - 1, self.seg) // tiles.ROWS + 1)
        view = lambda a: None if a is None else a[b0:b1]  # noqa: E731
        return dataclasses.replace(self, out_features=r1 - r0, data=view(self.data),
                                   scales=view(self.scales), mins=view(self.mins))

    def _dequant(self, ids: np.ndarray, out: np.ndarray) -> None:
        if not self.tiled:
            return super()._dequant(ids, out)
        mins = self.scales if self.mins is None else self.mins
        tiles.dequant_rows(tiles.tiled_row(np.asarray(ids, dtype=np.int64), self.seg), self.data,
                           self.scales, mins, self.fmt == "int4", self.group_size, out)

    def dequantize(self) -> np.ndarray:
        if not self.tiled:
            return super().dequantize()
        data, scales, mins = tiles.untile(self.data, self.scales, self.mins, self.out_features,
                                          self.seg, self.padded_in, self.fmt == "int4")
        G = self.padded_in // self.group_size
        shape = (self.out_features, G // 2 if self.fmt == "int4" else G, self.group_size)
        return Weight(self.fmt, self.out_features, self.in_features, self.group_size,
                      data.reshape(shape), scales, mins).dequantize()

    def _matmul_bf16(self, x: np.ndarray) -> np.ndarray:
        """Prefill on simd.py's bf16 GEMM: x [T, Kp] rounded to bf16 pairs once; bf16 weights as
        they are."""
        T, O = x.shape[0], self.out_features
        xb = fk.bf16_pairs(x, simd.TOKENS)                                # [Tp, Kp/2] bf16 pairs
        out = np.empty((T, O), dtype=np.float32)
        fk.matmul_bf16_prefill(xb, self.data.view(np.uint32), out)
        return out

    def matmul_ref(self, x: np.ndarray) -> np.ndarray:
        """The numpy twin: round x (and W, for bf16 prefill) as matmul does, then multiply."""
        x = self._check(x)
        w = self.dequantize()
        # decode rounds x to int8 / int16
        if self.decode_act != "fp32" and x.shape[0] < PREFILL_MIN_T:
            qmax = 127 if self.decode_act == "int8" else 32767
            x = quantize_activations(self._pad(x), self.group_size, qmax)[:, : self.in_features]
        # the integer GEMM's rounding
        if self.prefill_act in ("int8", "int16") and x.shape[0] >= PREFILL_MIN_T:
            qmax = 127 if self.prefill_act == "int8" else 32767
            x = quantize_activations(self._pad(x), self.group_size, qmax)[:, : self.in_features]
        # prefill rounds x and W to bf16
        if self.prefill_act == "bf16" and x.shape[0] >= PREFILL_MIN_T:
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
        # NaN where x has NaN / inf
        poison = (g * np.float32(0.0)).sum(axis=-1, keepdims=True)
        return ((np.rint(np.nan_to_num(g * inv)) * (scale + poison)).reshape(x.shape)
                .astype(np.float32))


def fast_quantize(w: np.ndarray, fmt: str, group_size: int = 32,
                  decode_act: str = "fp32", prefill_act: str = "fp32") -> FastWeight:
    """quant.quantize, then the activation rounding asked for (checked against this CPU)."""
    check_act(decode_act, prefill_act, fmt,
              w.in_features if isinstance(w, Weight) else np.shape(w)[-1])
    # (checked before quantizing)
    return as_fast(quantize(w, fmt, group_size), decode_act, prefill_act)


def as_fast(w: Weight, decode_act: str = "fp32", prefill_act: str = "fp32") -> FastWeight:
    """The same weights as a FastWeight: int8 / int4 ones whose activations are rounded go into
    8-row tiles (a copy, made once: tiles.py), any other the same arrays (no copy)."""
    check_act(decode_act, prefill_act, w.fmt, w.in_features)
    fields = {f.name: getattr(w, f.name) for f in dataclasses.fields(Weight)}
    if w.fmt in ("int8", "int4") and decode_act != "fp32":
        fields["data"], fields["scales"], fields["mins"] = tiles.to_tiles(w.data, w.scales, w.mins,
                                                                          w.out_features)
        return FastWeight(**fields, decode_act=decode_act, prefill_act=prefill_act,
                          seg=w.out_features)
    return FastWeight(**fields, decode_act=decode_act, prefill_act=prefill_act)


def check_act(decode_act: str, prefill_act: str, fmt: str, K: int) -> None:
    if (decode_act not in ("fp32", "int8", "int16")
            or prefill_act not in ("fp32", "bf16", "int8", "int16")):
        raise ValueError("decode activations are fp32, int8 or int16, prefill ones fp32, bf16, "
                         f"int8 or int16; got {decode_act!r}, {prefill_act!r}")
    here = f"here: {cpu.INT8 or 'none'}"
    if decode_act == "int8" and not (fmt in ("int8", "int4") and cpu.INT8):
        raise ValueError(f"int8 activations are not available for {fmt} weights on this CPU: "
                         "they need int8 / int4 weights and an int8 dot product (VNNI, AVX2 or "
                         f"ARM dotprod; {here}); use fp32")
    if decode_act == "int16" and not (fmt == "int8" and cpu.INT8):
        raise ValueError(f"int16 activations are not available for {fmt} weights on this CPU: "
                         "they need int8 weights and an int8 dot product (VNNI, AVX2 or ARM "
                         f"dotprod; {here}); use fp32")
    # the integer GEMM
    if prefill_act in ("int8", "int16") and not (fmt in ("int8", "int4") and cpu.INT8):
        raise ValueError(f"{prefill_act} prefill activations are not available for {fmt} weights "
                         "on this CPU: they need int8 / int4 weights and an int8 dot product "
                         f"(VNNI, AVX2 or ARM dotprod; {here}); use fp32")
    if prefill_act in ("int8", "int16") and decode_act == "fp32":
        raise ValueError(f"{prefill_act} prefill activations multiply the 8-row tiles that "
                         "rounded decode activations store the weights in: "
                         "set decode activations to int8 or int16 too")
    if prefill_act == "bf16" and not (cpu.BF16 and fmt == "bf16" and K % 2 == 0):
        raise ValueError(f"bf16 activations are not available for {fmt} weights [*, {K}] on "
                         f"this CPU: they need bf16 weights, an even in_features and "
                         f"AVX-512 BF16 (here: {'yes' if cpu.BF16 else 'no'}); use fp32")
