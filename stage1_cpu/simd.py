"""The CPU's dot-product instructions (int8, int16, bf16), called by name from numba.

Why: a decode matvec must unpack every weight it reads. The plain numba kernels
(kernels.matmul_int8 / matmul_int4) turn each weight into a float32 and multiply
it by a float32 activation: 4-6 vector instructions per 16 weights. One core
manages 13-16 G weights/s that way, which for int4 (0.625 byte/weight) is only
~8 GB/s of the ~30 GB/s the memory can deliver: int4 decode was compute-bound.

llama.cpp's answer, and ours: quantize the *activations* to int8 too (once per
matvec, per group of gs values: x ~ xq * xs), so that a group's dot product is a
sum of int8 x int8 products, and let `vpdpbusd` (AVX-512 VNNI / AVX-VNNI) do
32 of those multiply-adds per instruction:

    vpdpbusd acc, a, b:  acc[i] += a[4i]*b[4i] + ... + a[4i+3]*b[4i+3]
                         (a: 32 unsigned bytes, b: 32 signed bytes, acc: 8 x int32)

so one row's dot product becomes, per group g (W = q * s + m, x = xq * xs):

    sum_j W[g,j] x[g,j] = s[g] xs[g] * sum_j q[g,j] xq[g,j]  +  m[g] * sum_j x[g,j]
                          \\_ int32, exact, by vpdpbusd _/       int4 only (its minimum)

The integer sum is exact; float rounding enters once per group. numba has no
vector types and LLVM does not find vpdpbusd in a scalar loop, so this module
writes the inner loop of one row in LLVM IR (llvmlite, the library numba itself
emits code with) and exposes it as a numba intrinsic: inside a @njit kernel it
is called like a function and inlined like any other code. Everything around it
(threads, activation quantization, the min term) stays plain numba, in kernels.py.

Cost of the approximation: the activations lose what int8 cannot hold, as in
llama.cpp, where Q8_0 / Q4_0 weights always meet int8 activations. Measured on
the default model, 200 tokens decoded one at a time: perplexity +0.5 % (int8
weights) and -0.6 % (int4), noise either way (tests/test_quant_quality.py). The
lm_head, where a close top-2 can tip, gets int16 activations instead
(dot_int8_row_i16, vpdpwssd). The numpy twin (quant.Weight.matmul_ref) rounds
the same way, so the kernels are still checked exactly against a definition.

Only used where the CPU has the instruction (VNNI below); elsewhere stage 1 keeps
the float kernels. Vectors are 256 bits wide (32 bytes): on AMD Zen 4 a 512-bit
op costs two 256-bit ones anyway, and 256 bits is the width of AVX-VNNI too
(untested here: this machine has AVX-512).

The same idea serves bf16 prefill (the last section, dot_bf16_panel): a GEMM
whose inner instruction is vdpbf16ps, a bf16 x bf16 -> fp32 multiply-add of 32
pairs, twice the fp32 FMA's throughput. With the activations rounded to bf16
(as llama.cpp and transformers' bf16 models do) the [512, 1024] x [1024, 6144]
product of a prefill runs at ~350 GFLOP/s on 2 cores against OpenBLAS sgemm's
~180.
"""
from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core import config as numba_config
from numba.extending import intrinsic

_features = llvm.get_host_cpu_features()
# numba compiles for this CPU unless NUMBA_CPU_NAME says otherwise (e.g. "generic" for a portable
# cache): then these instructions may not exist on the target, and the float kernels are used
_host = numba_config.CPU_NAME in (None, "host")
# vpdpbusd on 256-bit registers: AVX-512 VNNI with AVX-512 VL (Ice Lake+, Zen 4+), or AVX-VNNI (Alder Lake+)
VNNI = _host and bool(_features.get("avxvnni") or (_features.get("avx512vnni") and _features.get("avx512vl")))
# vdpbf16ps on 512-bit registers: AVX-512 BF16 (Cooper Lake, Sapphire Rapids+, Zen 4+)
BF16 = _host and bool(_features.get("avx512bf16"))

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
BYTES32 = ir.VectorType(I8, 32)       # one 256-bit register of bytes
INTS8 = ir.VectorType(I32, 8)         # ... of int32 lanes
FLOATS8 = ir.VectorType(F32, 8)       # ... of float32 lanes


def _declare(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _base(context, builder, aty, ary, elem):
    """Pointer to element 0 of a numba array (the kernels pass C-contiguous 1-D views)."""
    return builder.bitcast(context.make_array(aty)(context, builder, ary).data, elem.as_pointer())


def _as_int64(context, builder, signature, args):
    """Integer arguments (offsets, counts) widened to int64; arrays passed through."""
    return [context.cast(builder, a, t, types.int64) if isinstance(t, types.Integer) else a
            for a, t in zip(args, signature.args)]


def _log2_per_group(builder, gs):
    """log2(gs / 32), the chunks per group as a shift (0, 1, 2 for gs = 32, 64, 128):
    a division in the loop would cost more than the rest of a chunk's work."""
    cttz = _declare(builder, "llvm.cttz.i64", I64, [I64, ir.IntType(1)])
    return builder.sub(builder.call(cttz, [gs, ir.Constant(ir.IntType(1), 0)]), ir.Constant(I64, 5))


def _load32(builder, base, index):
    """32 bytes starting at base[index] (no alignment assumed)."""
    return builder.load(builder.bitcast(builder.gep(base, [index]), BYTES32.as_pointer()), align=1)


def _half(builder, base, index):
    """fp16 bits at base[index] -> float32 (one vcvtph2ps)."""
    return builder.fpext(builder.bitcast(builder.load(builder.gep(base, [index])), ir.HalfType()), F32)


def _splat(builder, value):
    """float32 -> 8 lanes of it."""
    one = builder.insert_element(ir.Constant(FLOATS8, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(FLOATS8, ir.Undefined), ir.Constant(INTS8, [0] * 8))


def _vpdpbusd(builder, unsigned, signed):
    """32 unsigned bytes . 32 signed bytes -> 8 int32 lanes, each the sum of 4 products."""
    fn = _declare(builder, "llvm.x86.avx512.vpdpbusd.256", INTS8, [INTS8, INTS8, INTS8])
    return builder.call(fn, [ir.Constant(INTS8, None), builder.bitcast(unsigned, INTS8),
                             builder.bitcast(signed, INTS8)])


def _emit_row(builder, n_steps, step, tail=None):
    """The row's dot product: sum of float(int dot of a chunk) * its scale over all chunks.

    A chunk is 32 weights, whose integer dot product comes as 8 int32 lanes
    (one vpdpbusd, or two vpdpwssd for int16 activations). The lanes are
    converted to float and multiplied by the chunk's scale (its group's: a group
    of gs weights is gs / 32 chunks); the 8 float lanes are added up once per
    row, not once per chunk. step(i) gives the two chunks of loop step i as
    (int32 lanes, scale) pairs; they go to two accumulators, so that a chunk
    does not wait for the previous chunk's multiply-add (4 cycles). tail()
    gives one more chunk, if any."""
    fma = _declare(builder, "llvm.fma.v8f32", FLOATS8, [FLOATS8] * 3)
    acc = [cgutils.alloca_once_value(builder, ir.Constant(FLOATS8, None)) for _ in range(2)]

    def add_chunk(chunk, slot):                 # slot += float(int dot of the chunk) * its scale
        dot, scale = chunk
        lanes = builder.sitofp(dot, FLOATS8)
        builder.store(builder.call(fma, [lanes, _splat(builder, scale), builder.load(slot)]), slot)

    with cgutils.for_range(builder, n_steps) as loop:
        for chunk, slot in zip(step(loop.index), acc):
            add_chunk(chunk, slot)
    if tail is not None:
        tail(lambda chunk: add_chunk(chunk, acc[0]))
    both = builder.fadd(builder.load(acc[0]), builder.load(acc[1]))
    total = _declare(builder, "llvm.vector.reduce.fadd.v8f32", F32, [F32, FLOATS8])
    return builder.call(total, [ir.Constant(F32, 0.0), both], fastmath=("reassoc",))


def _scale(builder, sp, xsp, g):
    """Scale of group g: the weight's (fp16) times the activation's."""
    return builder.fmul(_half(builder, sp, g), builder.load(builder.gep(xsp, [g])))


@intrinsic
def dot_int4_row(typingctx, q, qoff, xq, xoff, s, soff, xs, xsoff, n_groups, gs):
    """Row r of an int4 matrix times one token's int8 activations, without the
    minimum term:  sum_g s[g] * xs[g] * sum_j nibble[g, j] * xq[g, j].

    q: uint8 bytes of the matrix (kernels.matmul_int4's [O, P, gs] layout, flat),
    the row starting at qoff; xq: int8 activations, the token's at xoff; s: fp16
    scale bits, the row's at soff; xs: activation scales, the token's at xsoff.
    Group 2p is the low nibbles of pair p's gs bytes, group 2p+1 the high ones."""
    sig = types.float32(q, qoff, xq, xoff, s, soff, xs, xsoff, n_groups, gs)

    def codegen(context, builder, signature, args):
        q_, qoff_, xq_, xoff_, s_, soff_, xs_, xsoff_, n_groups_, gs_ = _as_int64(context, builder, signature, args)
        ty = signature.args
        qp = builder.gep(_base(context, builder, ty[0], q_, I8), [qoff_])
        xp = builder.gep(_base(context, builder, ty[2], xq_, I8), [xoff_])
        sp = builder.gep(_base(context, builder, ty[4], s_, I16), [soff_])
        xsp = builder.gep(_base(context, builder, ty[6], xs_, F32), [xsoff_])
        low4 = ir.Constant(BYTES32, [15] * 32)
        shift4 = ir.Constant(BYTES32, [4] * 32)
        shift = _log2_per_group(builder, gs_)                     # chunks per group = 1 << shift

        def step(i):
            # chunk c of pair p: 32 bytes, low nibbles in group 2p, high nibbles in group 2p+1
            p = builder.lshr(i, shift)
            c = builder.sub(i, builder.shl(p, shift))
            byte = _load32(builder, qp, builder.mul(i, ir.Constant(I64, 32)))
            chunks = []
            for half, nibbles in ((0, builder.and_(byte, low4)), (1, builder.lshr(byte, shift4))):
                g = builder.add(builder.mul(p, ir.Constant(I64, 2)), ir.Constant(I64, half))
                x = _load32(builder, xp, builder.mul(builder.add(builder.shl(g, shift), c),
                                                     ir.Constant(I64, 32)))
                chunks.append((_vpdpbusd(builder, nibbles, x), _scale(builder, sp, xsp, g)))  # 0..15 . -127..127
            return chunks

        n_pairs = builder.udiv(n_groups_, ir.Constant(I64, 2))
        return _emit_row(builder, builder.shl(n_pairs, shift), step)

    return sig, codegen


@intrinsic
def dot_int8_row(typingctx, q, qoff, xq, xa, xoff, s, soff, xs, xsoff, n_groups, gs):
    """Row r of an int8 matrix times one token's int8 activations:
    sum_g s[g] * xs[g] * sum_j q[g, j] * xq[g, j].

    vpdpbusd multiplies unsigned by signed bytes, and both sides are signed here,
    so the sign moves to the weight: q * xq = (q * sign(xq)) * |xq|, with
    xa = |xq| (computed once per matvec) and vpsignb flipping q where xq < 0."""
    sig = types.float32(q, qoff, xq, xa, xoff, s, soff, xs, xsoff, n_groups, gs)

    def codegen(context, builder, signature, args):
        q_, qoff_, xq_, xa_, xoff_, s_, soff_, xs_, xsoff_, n_groups_, gs_ = _as_int64(context, builder, signature, args)
        ty = signature.args
        qp = builder.gep(_base(context, builder, ty[0], q_, I8), [qoff_])
        xp = builder.gep(_base(context, builder, ty[2], xq_, I8), [xoff_])
        ap = builder.gep(_base(context, builder, ty[3], xa_, I8), [xoff_])
        sp = builder.gep(_base(context, builder, ty[5], s_, I16), [soff_])
        xsp = builder.gep(_base(context, builder, ty[7], xs_, F32), [xsoff_])
        psign = _declare(builder, "llvm.x86.avx2.psign.b", BYTES32, [BYTES32, BYTES32])
        shift = _log2_per_group(builder, gs_)                     # chunks per group = 1 << shift

        def chunk(k):
            at = builder.mul(k, ir.Constant(I64, 32))
            w = builder.call(psign, [_load32(builder, qp, at), _load32(builder, xp, at)])
            # |xq| unsigned, q * sign(xq) signed
            return _vpdpbusd(builder, _load32(builder, ap, at), w), _scale(builder, sp, xsp, builder.lshr(k, shift))

        def step(i):                                                # chunks 2i and 2i+1
            k = builder.mul(i, ir.Constant(I64, 2))
            return chunk(k), chunk(builder.add(k, ir.Constant(I64, 1)))

        def tail(add):                                              # an odd number of chunks
            with builder.if_then(builder.trunc(n_chunks, ir.IntType(1))):
                add(chunk(builder.sub(n_chunks, ir.Constant(I64, 1))))

        n_chunks = builder.shl(n_groups_, shift)
        return _emit_row(builder, builder.udiv(n_chunks, ir.Constant(I64, 2)), step, tail)

    return sig, codegen


@intrinsic
def dot_int8_row_i16(typingctx, q, qoff, x16, xoff, s, soff, xs, xsoff, n_groups, gs):
    """Row r of an int8 matrix times one token's int16 activations (x ~ x16 * xs,
    xs = max|x| / 32767 per group): sum_g s[g] * xs[g] * sum_j q[g, j] * x16[g, j].

    For the lm_head, where int8 activations can tip a close top-2 (weights.py):
    int16 keeps 15 bits of each activation, a rounding error of ~1e-5, at the
    cost of two vpdpwssd (16 int16 products each, in pairs) per 32 weights, the
    weights widened from bytes by vpmovsxbw. No overflow: |q x16| <= 127 * 32767,
    and a lane adds at most gs / 8 <= 16 of them."""
    sig = types.float32(q, qoff, x16, xoff, s, soff, xs, xsoff, n_groups, gs)

    def codegen(context, builder, signature, args):
        q_, qoff_, x16_, xoff_, s_, soff_, xs_, xsoff_, n_groups_, gs_ = _as_int64(context, builder, signature, args)
        ty = signature.args
        qp = builder.gep(_base(context, builder, ty[0], q_, I8), [qoff_])
        xp = builder.gep(_base(context, builder, ty[2], x16_, I16), [xoff_])
        sp = builder.gep(_base(context, builder, ty[4], s_, I16), [soff_])
        xsp = builder.gep(_base(context, builder, ty[6], xs_, F32), [xsoff_])
        vpdpwssd = _declare(builder, "llvm.x86.avx512.vpdpwssd.256", INTS8, [INTS8, INTS8, INTS8])
        bytes16, shorts16 = ir.VectorType(I8, 16), ir.VectorType(I16, 16)
        shift = _log2_per_group(builder, gs_)                     # chunks per group = 1 << shift

        def chunk(k):
            dot = ir.Constant(INTS8, None)
            for half in range(2):                                 # 16 weights each
                at = builder.add(builder.mul(k, ir.Constant(I64, 32)), ir.Constant(I64, 16 * half))
                w = builder.load(builder.bitcast(builder.gep(qp, [at]), bytes16.as_pointer()), align=1)
                x = builder.load(builder.bitcast(builder.gep(xp, [at]), shorts16.as_pointer()), align=2)
                dot = builder.call(vpdpwssd, [dot, builder.bitcast(builder.sext(w, shorts16), INTS8),
                                              builder.bitcast(x, INTS8)])
            return dot, _scale(builder, sp, xsp, builder.lshr(k, shift))

        def step(i):                                                # chunks 2i and 2i+1
            k = builder.mul(i, ir.Constant(I64, 2))
            return chunk(k), chunk(builder.add(k, ir.Constant(I64, 1)))

        def tail(add):                                              # an odd number of chunks
            with builder.if_then(builder.trunc(n_chunks, ir.IntType(1))):
                add(chunk(builder.sub(n_chunks, ir.Constant(I64, 1))))

        n_chunks = builder.shl(n_groups_, shift)
        return _emit_row(builder, builder.udiv(n_chunks, ir.Constant(I64, 2)), step, tail)

    return sig, codegen


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
        dpbf16 = _declare(builder, "llvm.x86.avx512bf16.dpbf16ps.512", FLOATS16, [FLOATS16, BF16S32, BF16S32])
        acc = [cgutils.alloca_once_value(builder, ir.Constant(FLOATS16, None)) for _ in range(TOKENS)]
        with cgutils.for_range(builder, k2n_) as loop:
            k2 = loop.index
            at = builder.gep(pp, [builder.mul(k2, ir.Constant(I64, PANEL))])
            w = builder.bitcast(builder.load(builder.bitcast(at, INTS16.as_pointer()), align=4), BF16S32)
            for t in range(TOKENS):
                pair = builder.load(builder.gep(xp, [builder.add(builder.mul(ir.Constant(I64, t), k2n_), k2)]))
                one = builder.insert_element(ir.Constant(INTS16, ir.Undefined), pair, ir.Constant(I32, 0))
                x = builder.shuffle_vector(one, ir.Constant(INTS16, ir.Undefined), ir.Constant(INTS16, [0] * 16))
                builder.store(builder.call(dpbf16, [builder.load(acc[t]), w, builder.bitcast(x, BF16S32)]), acc[t])
        for t in range(TOKENS):
            out = builder.bitcast(builder.gep(rp, [ir.Constant(I64, PANEL * t)]), FLOATS16.as_pointer())
            builder.store(builder.load(acc[t]), out, align=4)
        return context.get_dummy_value()

    return sig, codegen
