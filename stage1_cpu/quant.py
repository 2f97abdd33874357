"""Weight formats for stage 1: fp32, bf16, and group-wise int8 / int4 (docs/stage1.md, section
6: the bytes per weight, the layouts, why int8 is symmetric and int4 stores a minimum).

`quantize(w, fmt, group_size)` turns one fp32 matrix [out, in] into a `Weight` once, at load
time; the numba kernels (matmul.py) read its stored bytes and convert them in registers, never
rebuilding the fp32 matrix. `matmul_ref` is the numpy twin that defines the result
(dequantize, then matmul): slow, and used only by the tests.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from . import matmul

FORMATS = ("none", "bf16", "int8", "int4")
GROUP_SIZES = (32, 64, 128)

# Prefill: ROW_BLOCK rows at a time dequantized to an fp32 tile for BLAS (docs/stage1.md, section 7)
PREFILL_MIN_T = 8  # from 8 tokens, the tile beats T reads of each row (bench profile --tokens T)
ROW_BLOCK = 1024   # 1024 rows x 1024 fp32 = 4 MB: wide enough for OpenBLAS's threads, still in L3
QUANT_ROWS = 4096  # rows quantized at once: bounds the fp32 temporaries (~6 x rows x in x 4 bytes)


def f32_to_bf16_bits(w: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits (uint16), rounding to nearest, ties to even (as torch does).
    NaN stays NaN (quiet bit set, so rounding cannot turn it into inf)."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    # add 0x7FFF plus the lowest kept bit, then truncate: round half to even
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
    nan = np.isnan(w)
    if nan.any():
        rounded = np.where(nan, (u >> 16) | np.uint32(0x40), rounded)
    return rounded.astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


@dataclass(eq=False)
class Weight:
    """One matrix [out_features, in_features] in one storage format."""
    fmt: str                    # none | bf16 | int8 | int4
    out_features: int
    in_features: int
    group_size: int             # 0 for none / bf16
    # none [O, K] f32 | bf16 [O, K] u16 | int8 [O, G, gs] i8 | int4 [O, G/2, gs] u8
    data: np.ndarray
    scales: np.ndarray | None = None    # [O, G] fp16 bits (uint16): int8 / int4
    mins: np.ndarray | None = None      # [O, G] fp16 bits (uint16): int4

    @property
    def padded_in(self) -> int:
        """in_features rounded up to whole groups (Kp); to an even number of groups for int4."""
        if self.group_size == 0:
            return self.in_features
        return _padded(self.in_features, self.fmt, self.group_size)

    @property
    def nbytes(self) -> int:
        """Bytes read by one full matvec (the roofline's numerator)."""
        return sum(a.nbytes for a in (self.data, self.scales, self.mins) if a is not None)

    def __repr__(self) -> str:
        gs = f", group_size={self.group_size}" if self.group_size else ""
        return (f"Weight({self.fmt}, [{self.out_features}, {self.in_features}]{gs}, "
                f"{self.nbytes / 2**20:.1f} MiB)")

    # -- the numba kernels ----------------------------------------------------
    def matmul(self, x: np.ndarray) -> np.ndarray:
        """x [T, in] f32 -> x @ W.T [T, out] f32."""
        x = self._check(x)
        T = x.shape[0]
        if self.fmt == "none" and T >= PREFILL_MIN_T:
            return x @ self.data.T                        # BLAS, exact fp32
        x = self._pad(x)                                  # [T, Kp]
        if T >= PREFILL_MIN_T:
            return self._matmul_tiled(x)
        out = np.empty((T, self.out_features), dtype=np.float32)
        gs = self.group_size
        if self.fmt == "none":
            matmul.matmul_f32(x, self.data, out)
        elif self.fmt == "bf16":
            matmul.matmul_bf16(x, self.data, out)
        elif self.fmt == "int8":
            # x as [T, G, gs]
            matmul.matmul_int8(x.reshape(T, -1, gs), self.data, self.scales, out)
        else:
            # x as [T, G/2, 2, gs]
            matmul.matmul_int4(x.reshape(T, -1, 2, gs), self.data, self.scales, self.mins, out)
        return out

    def part(self, r0: int, r1: int) -> "Weight":
        """Rows r0..r1-1 as a Weight of their own: views, no copy (one expert of a stack)."""
        view = lambda a: None if a is None else a[r0:r1]  # noqa: E731
        return dataclasses.replace(self, out_features=r1 - r0, data=view(self.data),
                                   scales=view(self.scales), mins=view(self.mins))

    def _matmul_tiled(self, x: np.ndarray) -> np.ndarray:
        """Prefill: dequantize ROW_BLOCK rows at a time into one fp32 tile and
        multiply the whole [T, Kp] activation block by it with BLAS. Each weight
        byte is read once for all T tokens; only the tile is ever fp32."""
        O = self.out_features
        out = np.empty((x.shape[0], O), dtype=np.float32)                   # [T, out]
        tile = np.empty((min(ROW_BLOCK, O), x.shape[1]), dtype=np.float32)  # [rows, Kp], in L2
        for r0 in range(0, O, ROW_BLOCK):
            r1 = min(O, r0 + ROW_BLOCK)
            t = tile[: r1 - r0]
            self._dequant(np.arange(r0, r1), t)
            # BLAS writes straight into the column block of out (no copy)
            np.matmul(x, t.T, out=out[:, r0:r1])                            # [T, rows]
        return out

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantize only rows `ids` [T] -> [T, in] f32 (the embedding lookup)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.out_features):
            raise IndexError(f"row ids must lie in [0, {self.out_features}); "
                             f"got {ids.min()}..{ids.max()}")
        if self.fmt == "none":
            return self.data[ids]
        out = np.empty((ids.size, self.padded_in), dtype=np.float32)
        self._dequant(ids, out)
        return np.ascontiguousarray(out[:, : self.in_features])   # copies only if padded

    def _dequant(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Rows ids of W into out [len(ids), Kp] f32."""
        R, gs = len(ids), self.group_size
        if self.fmt == "bf16":
            matmul.dequant_rows_bf16(ids, self.data, out)
        elif self.fmt == "int8":
            matmul.dequant_rows_int8(ids, self.data, self.scales, out.reshape(R, -1, gs))
        else:
            matmul.dequant_rows_int4(ids, self.data, self.scales, self.mins,
                                     out.reshape(R, -1, 2, gs))

    # -- the numpy twin that defines it ---------------------------------------
    def dequantize(self) -> np.ndarray:
        """The full fp32 matrix [out, in] (tests and references only)."""
        if self.fmt == "none":
            return self.data
        if self.fmt == "bf16":
            return bf16_bits_to_f32(self.data)
        O, gs = self.out_features, self.group_size
        s = self.scales.view(np.float16).astype(np.float32)[:, :, None]      # [O, G, 1]
        if self.fmt == "int8":
            w = self.data.astype(np.float32) * s                              # [O, G, gs]
        else:
            b = self.data                                                     # [O, G/2, gs] bytes
            # [O, G, gs]: group 2p low, 2p+1 high
            q = np.stack([b & 15, b >> 4], axis=2).reshape(O, -1, gs)
            q = q.astype(np.float32)
            w = q * s + self.mins.view(np.float16).astype(np.float32)[:, :, None]
        return w.reshape(O, -1)[:, : self.in_features]

    def matmul_ref(self, x: np.ndarray) -> np.ndarray:
        x = self._check(x)
        return (x @ self.dequantize().T).astype(np.float32)

    # -- helpers ---------------------------------------------------------------
    def _check(self, x: np.ndarray) -> np.ndarray:
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"matmul expects x [T, {self.in_features}], got {list(x.shape)} "
                             f"for {self!r}")
        return np.ascontiguousarray(x, dtype=np.float32)

    def _pad(self, x: np.ndarray) -> np.ndarray:
        """Zero-pad x [T, in] to [T, Kp] so the last, padded group multiplies zeros."""
        Kp = self.padded_in
        if Kp == self.in_features:
            return x
        xp = np.zeros((x.shape[0], Kp), dtype=np.float32)
        xp[:, : self.in_features] = x
        return xp


def quantize(w: np.ndarray, fmt: str, group_size: int = 32) -> Weight:
    """fp32 [out, in] -> Weight in format fmt (none | bf16 | int8 | int4)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization {fmt!r}; choose one of {', '.join(FORMATS)}")
    # already group-quantized in this layout (a GGUF block, common/gguf_quant.py)
    if hasattr(w, "dequantize"):
        if w.fmt == fmt:
            return Weight(fmt, w.out_features, w.in_features, w.group_size, w.data, w.scales,
                          w.mins)
        w = w.dequantize()
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D weight [out, in], got shape {list(w.shape)}")
    O, K = w.shape
    if fmt == "none":
        return Weight("none", O, K, 0, np.ascontiguousarray(w, dtype=np.float32))
    if fmt == "bf16":
        data = np.empty((O, K), dtype=np.uint16)
        for r in range(0, O, QUANT_ROWS):
            data[r:r + QUANT_ROWS] = f32_to_bf16_bits(w[r:r + QUANT_ROWS])
        return Weight("bf16", O, K, 0, data)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size {group_size} is not supported; choose one of {GROUP_SIZES}")

    gs = group_size
    G = _padded(K, fmt, gs) // gs
    scales = np.empty((O, G), dtype=np.float16)
    if fmt == "int8":
        data = np.empty((O, G, gs), dtype=np.int8)
        mins = None
    else:
        data = np.empty((O, G // 2, gs), dtype=np.uint8)
        mins = np.empty((O, G), dtype=np.float16)
    for r in range(0, O, QUANT_ROWS):   # a 150k-row embedding needs no 4x-size temporaries
        rows = slice(r, min(O, r + QUANT_ROWS))
        # [rows, G, gs]: split each row into groups, the last ones padded with zeros
        g = np.zeros((rows.stop - r, G * gs), dtype=np.float32)
        g[:, :K] = w[rows]
        g = g.reshape(-1, G, gs)
        if fmt == "int8":
            data[rows], scales[rows] = _quantize_int8(g)
        else:
            data[rows], scales[rows], mins[rows] = _quantize_int4(g)
    return Weight(fmt, O, K, gs, data, scales=scales.view(np.uint16),
                  mins=None if mins is None else mins.view(np.uint16))


def _quantize_int8(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """g [R, G, gs] f32 -> q [R, G, gs] int8, scales [R, G] fp16. Symmetric:
    the largest |w| of a group maps to 127."""
    # exercise 1.8 begin
    s = _to_f16(np.abs(g).max(axis=-1) / 127.0)                          # [R, G]
    # quantize with the stored (fp16) scale
    sf = s.astype(np.float32)[:, :, None]
    inv = np.divide(1.0, sf, out=np.zeros_like(sf), where=sf > 0)       # all-zero group: q = 0
    q = np.clip(np.rint(g * inv), -127, 127).astype(np.int8)
    return q, s
    # exercise 1.8 end


def _quantize_int4(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """g [R, G, gs] f32 (G even) -> packed [R, G/2, gs] uint8, scales and mins
    [R, G] fp16. [min, max] of each group maps onto the 16 levels 0..15."""
    # exercise 1.10 begin
    lo = g.min(axis=-1)
    hi = g.max(axis=-1)
    s = _to_f16((hi - lo) / 15.0)                                       # [R, G]
    m = _to_f16(lo)
    sf = s.astype(np.float32)[:, :, None]
    # constant group: q = 0, W = m
    inv = np.divide(1.0, sf, out=np.zeros_like(sf), where=sf > 0)
    q = np.clip(np.rint((g - m.astype(np.float32)[:, :, None]) * inv), 0, 15).astype(np.uint8)
    # pack pairs of groups: byte j of pair p = weight j of group 2p (low nibble)
    #                                        | weight j of group 2p+1 (high nibble)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)                             # [R, G/2, gs]
    return packed, s, m
    # exercise 1.10 end


def _padded(K: int, fmt: str, gs: int) -> int:
    """in_features rounded up to whole groups; int4 packs groups in pairs, so an even number."""
    groups = -(-K // gs)
    if fmt == "int4":
        groups += groups % 2
    return groups * gs


def _to_f16(a: np.ndarray) -> np.ndarray:
    """fp32 -> fp16 for scales; refuses values fp16 cannot hold rather than store inf."""
    if not np.all(np.isfinite(a)) or np.abs(a).max(initial=0) > 65000:
        raise ValueError("weights too large (or not finite) for fp16 group scales; "
                         "use --quant bf16 or none")
    return a.astype(np.float16)
