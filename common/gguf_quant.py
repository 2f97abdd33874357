"""GGUF blocks -> stage 1's group-quantized arrays, by reordering bytes
where the values map exactly.

llama.cpp's block formats are group quantization: a block of 32 (or 256) weights
with one scale (and, for some, a minimum). Stage 1 stores the same thing as
separate arrays (stage1_cpu/quant.py):

  int8  data [O, G, 32] int8 (q in [-127, 127]), W = q * s,      scales [O, G] fp16 bits
  int4  data [O, G/2, 32] uint8, W = q * s + m (q in 0..15),      scales, mins [O, G] fp16 bits
        byte j of pair p: weight j of group 2p in the low nibble,
        weight j of group 2p+1 in the high nibble; G padded to even

So most blocks become stage 1's arrays with no arithmetic on the weights
(docs/gguf.md has the byte layouts side by side):

  Q8_0  d, q[32]               W = d*q              -> int8 g32, exact (q = -128: see below)
  Q5_0  d, qh, qs              W = d*(q - 16)       -> int8 g32, exact (q - 16 in [-16, 15])
  Q4_0  d, qs[16]              W = d*(q - 8)        -> int4 g32, exact: s = d, m = -8d (exact
                                                       in fp16 while |d| <= 8188; above, int8
                                                       g32, also exact)
  Q4_1  d, m, qs[16]           W = d*q + m          -> int4 g32, exact
  Q4_K  d, dmin, 8 x (sc, mn) 6-bit, qs[128] per 256
                               W = d*sc*q - dmin*mn -> int4 g32: the nibbles are byte for byte
                                                       stage 1's pairs; s = d*sc and m = -dmin*mn
                                                       rounded to fp16
  Q5_1, Q5_K, Q6_K             five or six bits     -> int8 g32, requantized from the dequantized
                                                       values (int4 would drop bits; int8's 255
                                                       levels per 32 weights keep the most)

A Q8_0 block holding -128 cannot be stage 1's int8 (its AVX2 path needs |q| <= 127,
llama.cpp's quantizer never writes it): such a block is requantized from its values
(s = max|W| / 127) and a warning names the tensor and the count.

F32 stays float32, F16 and BF16 become float32 (exact). Every other type is refused,
naming the type and the tensor.

`Packed` holds the arrays in stage 1's layout; stage 1's quant.quantize accepts one
as it is (a tensor already in its format). Nothing here imports a stage.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import numpy as np

GS = 32     # the group size every mapping here produces

# GGML type name -> what stage 1 keeps it as, for the banner and docs/gguf.md
MAPPINGS = {
    "F32": "fp32",
    "F16": "fp32 (exact)",
    "BF16": "fp32 (exact)",
    "Q8_0": "int8 g32 (exact)",
    "Q5_0": "int8 g32 (exact)",
    "Q4_0": "int4 g32 (exact)",
    "Q4_1": "int4 g32 (exact)",
    "Q4_K": "int4 g32 (scales rounded to fp16)",
    "Q5_1": "int8 g32 (requantized)",
    "Q5_K": "int8 g32 (requantized)",
    "Q6_K": "int8 g32 (requantized)",
}
FLOAT_TYPES = ("F32", "F16", "BF16")


class GGUFTypeError(ValueError):
    """A tensor whose GGML type this engine does not map; the message names both."""


@dataclass(eq=False)
class Packed:
    """One matrix [out, in] in stage 1's int8 / int4 layout (the fields of
    stage1_cpu.quant.Weight)."""
    fmt: str                    # int8 | int4
    out_features: int           # O
    in_features: int            # K
    group_size: int             # 32
    data: np.ndarray            # int8 [O, G, 32] | int4 [O, G/2, 32] uint8
    scales: np.ndarray          # [O, G] fp16 bits (uint16)
    mins: np.ndarray | None = None      # [O, G] fp16 bits (uint16): int4
    source: str = ""            # the GGML type it came from (Q4_1, Q4_K, ...)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def dequantize(self) -> np.ndarray:
        """fp32 [O, K], computed as stage 1's Weight.dequantize does (q * s, or q * s + m)."""
        O = self.out_features
        s = self.scales.view(np.float16).astype(np.float32)[:, :, None]      # [O, G, 1]
        if self.fmt == "int8":
            w = self.data.astype(np.float32) * s
        else:
            b = self.data
            q = np.stack([b & 15, b >> 4], axis=2).reshape(O, -1, GS).astype(np.float32)
            w = q * s + self.mins.view(np.float16).astype(np.float32)[:, :, None]
        return w.reshape(O, -1)[:, : self.in_features]

    def take_rows(self, rows) -> "Packed":
        """Rows (a slice or an index array) as a Packed of their own."""
        pick = lambda a: None if a is None else np.ascontiguousarray(a[rows])   # noqa: E731
        data = pick(self.data)
        return replace(self, out_features=data.shape[0], data=data, scales=pick(self.scales),
                       mins=pick(self.mins))


def concat(parts: list[Packed]) -> Packed:
    """Packed matrices of one in_features stacked by rows (q, k, v -> qkv). Parts of different
    formats (a Q4_K q_proj beside a Q6_K v_proj) all become int8: int4 values are requantized."""
    if len({p.fmt for p in parts}) > 1:
        parts = [p if p.fmt == "int8"
                 else quantize_int8(p.dequantize(), p.source + " (fused with int8)")
                 for p in parts]
    cat = lambda name: (None if getattr(parts[0], name) is None      # noqa: E731
                        else np.concatenate([getattr(p, name) for p in parts]))
    return replace(parts[0], out_features=sum(p.out_features for p in parts), data=cat("data"),
                   scales=cat("scales"), mins=cat("mins"),
                   source="+".join(dict.fromkeys(p.source for p in parts)))


# ----------------------------------------------------------------------------- block fields

def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """Raw bytes of R rows [R, nb * block_bytes] -> [R, nb, block_bytes]."""
    raw = np.ascontiguousarray(raw).view(np.uint8)
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _u16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte `at` of every block [R, nb, bytes] -> its bits [R, nb] uint16."""
    return np.ascontiguousarray(b[..., at:at + 2]).view(np.uint16)[..., 0]


def _f32(bits: np.ndarray) -> np.ndarray:
    return bits.view(np.float16).astype(np.float32)


def _pack_int4(q: np.ndarray, s: np.ndarray, m: np.ndarray, K: int, source: str) -> Packed:
    """q [R, G, 32] in 0..15, s and m [R, G] fp16 bits -> int4 Packed (G padded to even)."""
    R, G = s.shape
    if G % 2:   # one zero group: q = 0, s = 0, m = 0 is the weight 0, as quantize pads
        q = np.concatenate([q, np.zeros((R, 1, GS), np.uint8)], axis=1)
        s = np.concatenate([s, np.zeros((R, 1), np.uint16)], axis=1)
        m = np.concatenate([m, np.zeros((R, 1), np.uint16)], axis=1)
    # [R, G/2, 32]: groups 2p low, 2p+1 high
    data = q[:, 0::2] | (q[:, 1::2] << 4)
    return Packed("int4", R, K, GS, np.ascontiguousarray(data), s, m, source)


def _nibbles_q4(qs: np.ndarray) -> np.ndarray:
    """Q4_0 / Q4_1 qs [R, nb, 16]: byte j holds weight j (low) and j + 16 (high)
    -> q [R, nb, 32]."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def quantize_int8(w: np.ndarray, source: str) -> Packed:
    """fp32 [R, K] (K % 32 == 0) -> int8 g32, as stage 1 quantizes: s = fp16(max|w| / 127),
    q = round(w / s) (the reference for every requantized mapping)."""
    R, K = w.shape
    g = np.asarray(w, np.float32).reshape(R, -1, GS)
    s = (np.abs(g).max(axis=-1) / 127.0).astype(np.float16)                      # [R, G]
    sf = s.astype(np.float32)[:, :, None]
    inv = np.divide(1.0, sf, out=np.zeros_like(sf), where=sf > 0)
    q = np.clip(np.rint(g * inv), -127, 127).astype(np.int8)
    return Packed("int8", R, K, GS, q, s.view(np.uint16), None, source)


# ----------------------------------------------------------------------------- one mapping per type

def _q8_0(raw, K, name):
    b = _blocks(raw, 34)                                      # d fp16, q int8[32]
    d = _u16(b, 0)
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8)        # [R, G, 32]
    bad = (q == -128).any(axis=-1)                            # [R, G]
    if bad.any():
        # requantize just those blocks from their values: s = max|W| / 127
        warnings.warn(f"{name}: {int(bad.sum())} Q8_0 block(s) hold -128, outside stage 1's int8 "
                      "range [-127, 127]; requantized from their values", stacklevel=3)
        q, d = q.copy(), d.copy()
        w = q[bad].astype(np.float32) * _f32(d[bad])[:, None]
        fix = quantize_int8(w, "Q8_0")
        q[bad], d[bad] = fix.data[:, 0], fix.scales[:, 0]
    return Packed("int8", q.shape[0], K, GS, q, d, None, "Q8_0")


def _q5_0(raw, K, name):
    b = _blocks(raw, 22)                                      # d fp16, qh uint32, qs[16]
    # [R, G, 1]: bit j = 5th bit of weight j
    qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)
    hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)   # [R, G, 32]
    q = _nibbles_q4(b[..., 6:]) | (hi << 4)
    return Packed("int8", q.shape[0], K, GS, (q.astype(np.int16) - 16).astype(np.int8),
                  _u16(b, 0), None, "Q5_0")


def _q4_0(raw, K, name):
    b = _blocks(raw, 18)                                      # d fp16, qs[16]
    d, q = _u16(b, 0), _nibbles_q4(b[..., 2:])
    df = _f32(d)
    if np.abs(df).max(initial=0) > 8188:                      # -8d would overflow fp16 (65504)
        return Packed("int8", q.shape[0], K, GS, (q.astype(np.int16) - 8).astype(np.int8), d,
                      None, "Q4_0")
    m = (-8 * df).astype(np.float16).view(np.uint16)          # exact: times a power of two
    return _pack_int4(q, d, m, K, "Q4_0")


def _q4_1(raw, K, name):
    b = _blocks(raw, 20)                                      # d fp16, m fp16, qs[16]
    return _pack_int4(_nibbles_q4(b[..., 4:]), _u16(b, 0), _u16(b, 2), K, "Q4_1")


def _q4_k(raw, K, name):
    # per 256: d, dmin, scales[12], qs[128]
    b = _blocks(raw, 144)
    R, nb = b.shape[:2]
    d, dmin = _f32(_u16(b, 0)), _f32(_u16(b, 2))              # [R, nb]
    sc6 = b[..., 4:16].reshape(R, nb, 3, 4)                   # 8 scales and 8 mins of 6 bits
    lo, mid, top = sc6[:, :, 0], sc6[:, :, 1], sc6[:, :, 2]
    sc = np.concatenate([lo & 63, (top & 15) | ((lo >> 2) & 48)], axis=-1)      # [R, nb, 8]
    mn = np.concatenate([mid & 63, (top >> 4) | ((mid >> 2) & 48)], axis=-1)
    s = (d[..., None] * sc).astype(np.float16).reshape(R, -1)          # [R, G]  rounded to fp16
    m = (-(dmin[..., None] * mn)).astype(np.float16).reshape(R, -1)
    if not (np.isfinite(s).all() and np.isfinite(m).all()):
        raise GGUFTypeError(f"{name}: Q4_K scales overflow fp16; this file cannot be kept as int4 "
                            "(pass --quant int8 or bf16)")
    # qs: 4 runs of 32 bytes per 256 weights, run c = sub-blocks 2c (low nibbles) and 2c+1 (high):
    # byte for byte stage 1's int4 pair layout, so the nibbles are kept as they are
    data = np.ascontiguousarray(b[..., 16:]).reshape(R, nb * 4, GS)
    return Packed("int4", R, K, GS, data, s.view(np.uint16), m.view(np.uint16), "Q4_K")


def _requantized(qtype: str):
    def repack(raw, K, name):
        from gguf.quants import dequantize
        import gguf
        w = dequantize(np.ascontiguousarray(raw), gguf.GGMLQuantizationType[qtype])
        return quantize_int8(w.reshape(-1, K), qtype)
    return repack


REPACK = {"Q8_0": _q8_0, "Q5_0": _q5_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k,
          "Q5_1": _requantized("Q5_1"), "Q5_K": _requantized("Q5_K"), "Q6_K": _requantized("Q6_K")}


def repack(raw: np.ndarray, qtype: str, in_features: int, name: str = "tensor") -> Packed:
    """Raw GGUF bytes of R rows [R, row_bytes] of type qtype -> Packed [R, in_features]."""
    if qtype not in REPACK:
        raise GGUFTypeError(f"tensor {name!r} has GGML type {qtype}, which stage 1 does not map; "
                            f"supported: {', '.join(MAPPINGS)}")
    return REPACK[qtype](raw, in_features, name)


def check_type(qtype: str, name: str) -> None:
    if qtype not in MAPPINGS:
        raise GGUFTypeError(f"tensor {name!r} has GGML type {qtype}, which this engine does not "
                            f"read; supported: {', '.join(MAPPINGS)}. Requantize the file "
                            "(llama-quantize) to one of those, or use the model's Hugging Face "
                            "folder")
