"""The CPU's dot-product instructions (int8, int16, bf16), called by name from numba.

Why: a decode matvec must unpack every weight it reads. The core's kernels
(stage1_cpu/kernels.py: matmul_int8, matmul_int4) turn each weight into a
float32 and multiply it by a float32 activation: several vector instructions
per 16 weights, so that one core converts int8 and int4 weights more slowly
than the memory delivers their bytes. int8 / int4 decode was compute-bound
(the measurements are in docs/benchmarks.md).

llama.cpp's answer, and ours: quantize the *activations* to int8 too (once per
matvec, per group of gs values: x ~ xq * xs), so that a group's dot product is a
sum of int8 x int8 products, done by the CPU's integer dot-product instructions:

    vpdpbusd acc, a, b:  acc[i] += a[4i]*b[4i] + ... + a[4i+3]*b[4i+3]
                         (a: 32 unsigned bytes, b: 32 signed bytes, acc: 8 x int32)

so one row's dot product becomes, per group g (W = q * s + m, x = xq * xs):

    sum_j W[g,j] x[g,j] = s[g] xs[g] * sum_j q[g,j] xq[g,j]  +  m[g] * sum_j x[g,j]
                          \\_ int32, exact, by vpdpbusd _/       int4 only (its minimum)

The integer sum is exact; float rounding enters once per group. numba has no
vector types and LLVM does not find vpdpbusd in a scalar loop, so this module
writes the instructions in LLVM IR (llvmlite, the library numba itself emits
code with); tiles.py builds its register tile from them and exposes it as a
numba intrinsic: inside a @njit kernel it is called like a function and inlined
like any other code. Everything around it (threads, activation rounding) stays
plain numba, in stage1_cpu/fast/kernels.py.

Which instructions, decided by cpu.py (cpu.INT8) before anything here is compiled:
  "vnni"  vpdpbusd (and vpdpwssd for int16), AVX-512 VNNI with VL or AVX-VNNI:
          32 int8 multiply-adds into 8 int32 lanes, one instruction.
  "avx2"  the same sums in two instructions, as llama.cpp does on AVX2 CPUs:
          vpmaddubsw (unsigned x signed bytes, adjacent pairs added into 16
          int16 lanes) and vpmaddwd by ones (pairs of int16 into int32). The
          int16 step saturates at 32767, so each pair sum must stay within it:
          the tiles pass |xq| (<= 127) against q * sign(xq) (|.| <= 127) or
          nibbles (<= 15) against xq, never VNNI's q + 128, whose 255 * 127 * 2
          would saturate.
  "sdot"  ARM64 with dotprod: two sdot per 32 bytes (NEON registers are 128 bits:
          16 signed x signed bytes into 4 int32 lanes each), the lanes in the
          same order as vpdpbusd's, so every tile keeps its shape. Both sides
          signed: int8 weights meet xq as they are (no sign or + 128 trick),
          nibbles (0..15) too. int16 pairs (the lm_head's activations) have no ARM
          dot instruction: the products are widened to int32 and added in pairs
          (smull / smlal and addp), the same sums.
  None    nothing here is compiled; the fast path keeps the core's float kernels.
A kernel that names an instruction the target lacks does not run slowly: LLVM
aborts the process ("Cannot select ... VPDPWSSD"). Hence the choice is made in
Python, and nothing that every CPU compiles refers to these intrinsics.

Cost of the approximation: the activations lose what int8 cannot hold, as in
llama.cpp, where Q8_0 / Q4_0 weights always meet int8 activations. Measured on
the default model, 200 tokens decoded one at a time: perplexity within noise of
the float kernels (tests/test_quant_quality.py). The lm_head, where a close top-2
can tip, gets int16 activations instead (vpdpwssd or vpmaddwd). The numpy twin
(stage1_cpu/fast/weight.py: FastWeight.matmul_ref) rounds the same way, so the
tiles are still checked against a definition.

Vectors are 256 bits wide (32 bytes): the width of AVX2 and AVX-VNNI, and on
AMD Zen 4 a 512-bit op costs two 256-bit ones anyway.

The same idea serves bf16 prefill (the last section, dot_bf16_panel; AVX-512
BF16 only, cpu.BF16): a GEMM whose inner instruction is vdpbf16ps, a bf16 x bf16
-> fp32 multiply-add of 32 pairs, twice the fp32 FMA's throughput. With the
activations rounded to bf16 (as llama.cpp and transformers' bf16 models do) a
prefill's matmuls run at about twice OpenBLAS sgemm's FLOP/s.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import cpu

# Which instruction to emit is cpu.py's decision, made before anything here is compiled:
# these intrinsics are only ever compiled where cpu.INT8 (or cpu.BF16) says they exist.
VNNI = cpu.INT8 == "vnni"     # vpdpbusd / vpdpwssd on 256-bit registers
AVX2 = cpu.INT8 == "avx2"     # the same sums by vpmaddubsw / vpmaddwd
SDOT = cpu.INT8 == "sdot"     # ARM64: sdot on two 128-bit halves
BF16 = cpu.BF16               # vdpbf16ps on 512-bit registers

I8, I16, I32, I64, F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                          ir.FloatType())
BYTES32 = ir.VectorType(I8, 32)       # one 256-bit register of bytes
INTS8 = ir.VectorType(I32, 8)         # ... of int32 lanes
FLOATS8 = ir.VectorType(F32, 8)       # ... of float32 lanes
BYTES16 = ir.VectorType(I8, 16)       # one 128-bit (NEON) register of bytes
INTS4 = ir.VectorType(I32, 4)         # ... of int32 lanes
SHORTS16 = ir.VectorType(I16, 16)     # ... of int16 lanes


def _declare(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _base(context, builder, aty, ary, elem):
    """Pointer to element 0 of a numba array (the kernels pass C-contiguous 1-D views)."""
    return builder.bitcast(context.make_array(aty)(context, builder, ary).data, elem.as_pointer())


def _as_int64(context, builder, signature, args):
    """Integer arguments (offsets, counts) widened to int64; arrays passed through."""
    return [context.cast(builder, a, t, types.int64) if isinstance(t, types.Integer) else a
            for a, t in zip(args, signature.args)]


def _splat(builder, value):
    """float32 -> 8 lanes of it."""
    one = builder.insert_element(ir.Constant(FLOATS8, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(FLOATS8, ir.Undefined),
                                  ir.Constant(INTS8, [0] * 8))


def _vpdpbusd(builder, unsigned, signed, acc=None):
    """32 unsigned bytes . 32 signed bytes -> 8 int32 lanes, each the sum of 4 products
    (added to acc's lanes if given). VNNI: one vpdpbusd. AVX2: vpmaddubsw adds pairs
    of products into 16 int16 lanes (saturating: callers keep |pair sum| <= 2 * 255 * 127
    out of it, i.e. they pass |x| <= 127 against |w| <= 127, or nibbles), then
    vpmaddwd by ones adds pairs of those into int32: the same sums, exactly. ARM: two
    sdot, one per 16-byte half, whose bytes are signed on both sides: there `unsigned`
    holds values below 128 (nibbles) or the signed activations themselves."""
    zero = ir.Constant(INTS8, None)
    if SDOT:
        fn = _declare(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", INTS4,
                      [INTS4, BYTES16, BYTES16])
        acc = zero if acc is None else acc
        half = [_half_of(builder, v, h) for v in (acc, unsigned, signed) for h in (0, 1)]
        lo, hi = (builder.call(fn, half[h::2]) for h in (0, 1))
        return builder.shuffle_vector(lo, hi, ir.Constant(INTS8, list(range(8))))
    if VNNI:
        fn = _declare(builder, "llvm.x86.avx512.vpdpbusd.256", INTS8, [INTS8, INTS8, INTS8])
        return builder.call(fn, [zero if acc is None else acc,
                                 builder.bitcast(unsigned, INTS8), builder.bitcast(signed, INTS8)])
    maddubs = _declare(builder, "llvm.x86.avx2.pmadd.ub.sw", SHORTS16, [BYTES32, BYTES32])
    pairs = builder.call(maddubs, [unsigned, signed])                       # 16 x int16
    quads = _vpdpwssd(builder, None, pairs, ir.Constant(SHORTS16, [1] * 16))
    return quads if acc is None else builder.add(acc, quads)


def _half_of(builder, v, h):
    """Half h (0: low, 1: high) of a 256-bit vector, as a 128-bit one (one NEON register)."""
    n = v.type.count // 2
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n),
                                                    list(range(h * n, h * n + n))))


def _vpdpwssd(builder, acc, a, b):
    """16 int16 . 16 int16 -> 8 int32 lanes, each the sum of 2 products (added to acc's
    lanes if given; acc None: from zero). VNNI: vpdpwssd; AVX2: vpmaddwd, then an add."""
    a, b = builder.bitcast(a, SHORTS16), builder.bitcast(b, SHORTS16)
    if SDOT:                            # no int16 dot on ARM: widen, multiply, add adjacent pairs
        wide = ir.VectorType(I32, 16)
        prod = builder.mul(builder.sext(a, wide), builder.sext(b, wide))
        dot = builder.add(*(builder.shuffle_vector(prod, prod,
                                                   ir.Constant(INTS8, list(range(j, 16, 2))))
                            for j in (0, 1)))
        return dot if acc is None else builder.add(acc, dot)
    if VNNI:
        fn = _declare(builder, "llvm.x86.avx512.vpdpwssd.256", INTS8, [INTS8, INTS8, INTS8])
        return builder.call(fn, [ir.Constant(INTS8, None) if acc is None else acc,
                                 builder.bitcast(a, INTS8), builder.bitcast(b, INTS8)])
    maddwd = _declare(builder, "llvm.x86.avx2.pmadd.wd", INTS8, [SHORTS16, SHORTS16])
    dot = builder.call(maddwd, [a, b])
    return dot if acc is None else builder.add(acc, dot)


def _halves8(builder, hp, g):
    """fp16 bits hp[g : g + 8] -> 8 float32 lanes (one vcvtph2ps)."""
    h = builder.load(builder.bitcast(builder.gep(hp, [g]), ir.VectorType(I16, 8).as_pointer()),
                     align=2)
    return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), FLOATS8)


# ---------------------------------------------------------------------------
# bf16 GEMM micro-kernel (prefill of bf16 weights). A panel is 16 weight rows,
# packed so that its 32-bit word [k2, i] holds the bf16 pair (W[i, 2k2], W[i, 2k2+1]):
# one 512-bit load is then 16 rows x 2 k. The activations come as bf16 pairs
# too, xb[t, k2] = (x[t, 2k2], x[t, 2k2+1]). vdpbf16ps(acc, w, splat(xb[t, k2]))
# adds W[i, 2k2] x[t, 2k2] + W[i, 2k2+1] x[t, 2k2+1] to lane i of acc (in fp32):
# TOKENS accumulators give a 16-row x TOKENS-token block of the output, each
# loaded weight pair serving TOKENS tokens from a register.
# ---------------------------------------------------------------------------


class _BFloat(ir.types._BaseFloatType):
    """LLVM's bfloat type, which llvmlite does not define (vdpbf16ps takes vectors of it)."""
    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"


_BFloat._create_instance()
PANEL = 16                                   # weight rows per panel: one 512-bit register of fp32
TOKENS = 8                                   # tokens per micro-kernel call: 8 accumulators
FLOATS16 = ir.VectorType(F32, 16)
INTS16 = ir.VectorType(I32, 16)
BF16S32 = ir.VectorType(_BFloat(), 32)


@intrinsic
def dot_bf16_panel(typingctx, panel, xb, xoff, k2n, res):
    """res[t * 16 + i] = sum_k2 dot(panel[k2, i], xb[xoff + t * k2n + k2]) for t < TOKENS,
    i < 16: a 16-row panel times TOKENS tokens. panel: uint32 [k2n, 16] (flat);
    xb: uint32 bf16 pairs of the activations, token t's row at xoff + t * k2n;
    res: float32 [TOKENS * 16]."""
    sig = types.void(panel, xb, xoff, k2n, res)

    def codegen(context, builder, signature, args):
        panel_, xb_, xoff_, k2n_, res_ = _as_int64(context, builder, signature, args)
        ty = signature.args
        pp = _base(context, builder, ty[0], panel_, I32)
        xp = builder.gep(_base(context, builder, ty[1], xb_, I32), [xoff_])
        rp = _base(context, builder, ty[4], res_, F32)
        dpbf16 = _declare(builder, "llvm.x86.avx512bf16.dpbf16ps.512", FLOATS16,
                          [FLOATS16, BF16S32, BF16S32])
        acc = [cgutils.alloca_once_value(builder, ir.Constant(FLOATS16, None))
               for _ in range(TOKENS)]
        with cgutils.for_range(builder, k2n_) as loop:
            k2 = loop.index
            at = builder.gep(pp, [builder.mul(k2, ir.Constant(I64, PANEL))])
            w = builder.bitcast(builder.load(builder.bitcast(at, INTS16.as_pointer()), align=4),
                                BF16S32)
            for t in range(TOKENS):
                pair = builder.load(builder.gep(
                    xp, [builder.add(builder.mul(ir.Constant(I64, t), k2n_), k2)]))
                one = builder.insert_element(ir.Constant(INTS16, ir.Undefined), pair,
                                             ir.Constant(I32, 0))
                x = builder.shuffle_vector(one, ir.Constant(INTS16, ir.Undefined),
                                           ir.Constant(INTS16, [0] * 16))
                builder.store(builder.call(dpbf16, [builder.load(acc[t]), w,
                                                    builder.bitcast(x, BF16S32)]), acc[t])
        for t in range(TOKENS):
            out = builder.bitcast(builder.gep(rp, [ir.Constant(I64, PANEL * t)]),
                                  FLOATS16.as_pointer())
            builder.store(builder.load(acc[t]), out, align=4)
        return context.get_dummy_value()

    return sig, codegen
