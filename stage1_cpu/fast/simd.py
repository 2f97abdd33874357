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
writes the inner loop of one row in LLVM IR (llvmlite, the library numba itself
emits code with) and exposes it as a numba intrinsic: inside a @njit kernel it
is called like a function and inlined like any other code. Everything around it
(threads, activation quantization, the min term) stays plain numba, in
stage1_cpu/fast/kernels.py.

Which instructions, decided by cpu.py (cpu.INT8) before anything here is compiled:
  "vnni"  vpdpbusd (and vpdpwssd for int16), AVX-512 VNNI with VL or AVX-VNNI:
          32 int8 multiply-adds into 8 int32 lanes, one instruction.
  "avx2"  the same sums in two instructions, as llama.cpp does on AVX2 CPUs:
          vpmaddubsw (unsigned x signed bytes, adjacent pairs added into 16
          int16 lanes) and vpmaddwd by ones (pairs of int16 into int32). The
          int16 step saturates at 32767, so each pair sum must stay within it:
          the kernels pass |xq| (<= 127) against q * sign(xq) (|.| <= 127) or
          against nibbles (<= 15), never the VNNI rows kernel's q + 128 trick,
          whose 255 * 127 * 2 would saturate (dot_int8_rows).
  None    nothing here is compiled; the fast path keeps the core's float kernels.
A kernel that names an instruction the target lacks does not run slowly: LLVM
aborts the process ("Cannot select ... VPDPWSSD"). Hence the choice is made in
Python, and nothing that every CPU compiles refers to these intrinsics.

Cost of the approximation: the activations lose what int8 cannot hold, as in
llama.cpp, where Q8_0 / Q4_0 weights always meet int8 activations. Measured on
the default model, 200 tokens decoded one at a time: perplexity +0.5 % (int8
weights) and -0.6 % (int4), noise either way (tests/test_quant_quality.py). The
lm_head, where a close top-2 can tip, gets int16 activations instead
(dot_int8_row_i16, vpdpwssd or vpmaddwd). The numpy twin
(stage1_cpu/fast/weight.py: FastWeight.matmul_ref) rounds the same way, so the
kernels are still checked exactly against a definition. dot_int8_rows /
dot_int8_rows_i16 do the same for up to 4 rows per call, sharing the
activations and vectorising the scales ("Four rows at a time" below), and
dot_int4_rows is the only int4 kernel: 4 rows of nibbles per call.

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
BF16 = cpu.BF16               # vdpbf16ps on 512-bit registers

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
BYTES32 = ir.VectorType(I8, 32)       # one 256-bit register of bytes
INTS8 = ir.VectorType(I32, 8)         # ... of int32 lanes
FLOATS8 = ir.VectorType(F32, 8)       # ... of float32 lanes
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


def _vpdpbusd(builder, unsigned, signed, acc=None):
    """32 unsigned bytes . 32 signed bytes -> 8 int32 lanes, each the sum of 4 products
    (added to acc's lanes if given). VNNI: one vpdpbusd. AVX2: vpmaddubsw adds pairs
    of products into 16 int16 lanes (saturating: callers keep |pair sum| <= 2 * 255 * 127
    out of it, i.e. they pass |x| <= 127 against |w| <= 127, or nibbles), then
    vpmaddwd by ones adds pairs of those into int32: the same sums, exactly."""
    zero = ir.Constant(INTS8, None)
    if VNNI:
        fn = _declare(builder, "llvm.x86.avx512.vpdpbusd.256", INTS8, [INTS8, INTS8, INTS8])
        return builder.call(fn, [zero if acc is None else acc,
                                 builder.bitcast(unsigned, INTS8), builder.bitcast(signed, INTS8)])
    maddubs = _declare(builder, "llvm.x86.avx2.pmadd.ub.sw", SHORTS16, [BYTES32, BYTES32])
    pairs = builder.call(maddubs, [unsigned, signed])                       # 16 x int16
    quads = _vpdpwssd(builder, None, pairs, ir.Constant(SHORTS16, [1] * 16))
    return quads if acc is None else builder.add(acc, quads)


def _vpdpwssd(builder, acc, a, b):
    """16 int16 . 16 int16 -> 8 int32 lanes, each the sum of 2 products (added to acc's
    lanes if given; acc None: from zero). VNNI: vpdpwssd; AVX2: vpmaddwd, then an add."""
    a, b = builder.bitcast(a, SHORTS16), builder.bitcast(b, SHORTS16)
    if VNNI:
        fn = _declare(builder, "llvm.x86.avx512.vpdpwssd.256", INTS8, [INTS8, INTS8, INTS8])
        return builder.call(fn, [ir.Constant(INTS8, None) if acc is None else acc,
                                 builder.bitcast(a, INTS8), builder.bitcast(b, INTS8)])
    maddwd = _declare(builder, "llvm.x86.avx2.pmadd.wd", INTS8, [SHORTS16, SHORTS16])
    dot = builder.call(maddwd, [a, b])
    return dot if acc is None else builder.add(acc, dot)


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


def _load8(builder, fp, g):
    """fp[g : g + 8] as 8 float32 lanes."""
    return builder.load(builder.bitcast(builder.gep(fp, [g]), FLOATS8.as_pointer()), align=4)


def _halves8(builder, hp, g):
    """fp16 bits hp[g : g + 8] -> 8 float32 lanes (one vcvtph2ps)."""
    h = builder.load(builder.bitcast(builder.gep(hp, [g]), ir.VectorType(I16, 8).as_pointer()), align=2)
    return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), FLOATS8)


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
        bytes16, shorts16 = ir.VectorType(I8, 16), ir.VectorType(I16, 16)
        shift = _log2_per_group(builder, gs_)                     # chunks per group = 1 << shift

        def chunk(k):
            dot = ir.Constant(INTS8, None)
            for half in range(2):                                 # 16 weights each
                at = builder.add(builder.mul(k, ir.Constant(I64, 32)), ir.Constant(I64, 16 * half))
                w = builder.load(builder.bitcast(builder.gep(qp, [at]), bytes16.as_pointer()), align=1)
                x = builder.load(builder.bitcast(builder.gep(xp, [at]), shorts16.as_pointer()), align=2)
                dot = _vpdpwssd(builder, dot, builder.sext(w, shorts16), x)
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
# Four rows at a time (decode matvecs). dot_int8_row spends ~15 instructions
# on 32 weights, a third of them scalar (the group's fp16 scale: load, convert,
# times xs, broadcast), which caps what one core reads from L2. The
# rows kernels below take up to 4 rows per call and do less per chunk:
# - the activations of a chunk are loaded once and serve the 4 rows;
# - the scales s[i, g] * xs[g] of 8 groups are one vcvtph2ps and one vmulps per
#   row, stored to a 32-float stack buffer; the multiply-adds read them with a
#   broadcast load (no arithmetic: a broadcast from a register is a shuffle,
#   and on Zen 4 shuffles compete with vpdpbusd for its two pipes);
# - int8 activations: no vpsignb per row. q + 128 is unsigned, so
#   vpdpbusd(q ^ 0x80, xq) = q . xq + 128 sum(xq), and the correction
#   -128 sum(xq) depends on the activations alone: one vpdpbusd per chunk for
#   all 4 rows, the rows' int32 sums start from it. (On Zen 4 vpdpbusd,
#   vpsignb and the float multiply-add share two pipes; the xor has four.)
# - int4 (dot_int4_rows): the same, on nibbles (gs / 2 bytes a group), and the
#   minimum's term sum_g m[g] xsum[g] of 8 groups is one vcvtph2ps and one
#   multiply-add per row, next to the scales (one row per call, with that term
#   a scalar loop, kept int4 decode compute-bound);
# - a group of gs > 32 weights is summed in int32 (vpdpbusd accumulates) and
#   converted to float once per group;
# - each row has two float accumulators (even and odd groups), whose 8 lanes
#   are added up once, at the end.
# The group loop is emitted for one group size, the last argument's (chunks(gs): for
# 32, 64, 128, 1, 2 or 4 chunks unrolled; for any other multiple of 32, a loop over the chunks).
# One core, weights in L2: about 1.5x dot_int8_row's weights per second (int8
# activations), about 1.3x with int16 (docs/benchmarks.md).
#
# Memory: the 4 rows are 4 streams. Adjacent rows, 4 streams one row apart,
# defeat the hardware prefetcher (one core then reads DRAM at a fraction of its
# speed); the kernels prefetch the next call's 4 rows in that case, and 2 threads
# reach ~2/3 of the read bandwidth. Rows m > 1 rows apart (e.g. rows b, b + O/4,
# b + O/2, b + 3 O/4 in call b) are 4 long sequential streams, which the
# hardware prefetcher follows: 2 threads then read at about the memory's speed,
# as bench.common.measure_bandwidth measures it next to them (docs/benchmarks.md).
# ---------------------------------------------------------------------------

ROWS = 4                                     # rows per call of the rows kernels


def _rows_pointers(builder, base, off, stride, n_rows):
    """base + off + i * stride for the ROWS rows; a row i >= n_rows points at row 0
    (it is computed, never stored, and never read out of bounds)."""
    ptrs = []
    for i in range(ROWS):
        step = builder.mul(ir.Constant(I64, i), stride)
        real = builder.icmp_signed("<", ir.Constant(I64, i), n_rows)
        ptrs.append(builder.gep(base, [builder.add(off, builder.select(real, step, ir.Constant(I64, 0)))]))
    return ptrs


def _rows_apart(builder, row_stride, n_groups, gs):
    """m = row_stride // (n_groups * gs), at least 1: how many matrix rows apart the
    call's rows are (1 for adjacent rows, and for any row_stride < 2 rows)."""
    one = ir.Constant(I64, 1)
    row = builder.mul(n_groups, gs)
    m = builder.udiv(row_stride, builder.select(builder.icmp_unsigned("<", row, one), one, row))
    return builder.select(builder.icmp_unsigned("<", m, one), one, m)


def chunks(gs: int) -> tuple:
    """The rows kernels' last argument: the group size as a type, so that each compiles
    the group loop of the model's group size only. gs = 32, 64, 128: a tuple of 1, 2 or
    4 zeros, the chunks of a group, unrolled; any other multiple of 32: (), a loop over
    the chunks. numba compiles one body per tuple length (the length is part of the
    type): emitting every size at every call site made a cold start four times longer."""
    return (0,) * (gs // 32) if gs in (32, 64, 128) else ()


def _by_group_size(builder, gs, emit, unrolled):
    """emit(chunks per group): a Python int when the kernel is compiled for one group
    size (unrolled: chunks()'s tuple length), else an i64 value (any multiple of 32)."""
    emit(unrolled if unrolled else builder.lshr(gs, ir.Constant(I64, 5)))


def _fold_chunks(builder, chunks, start, init, step):
    """values = step(at, values) over a group's chunks (at: the chunk's element
    offset, start + 32 c), from values = init: unrolled when chunks is a Python
    int, else a loop (its values in stack slots made once, in the entry block)."""
    if isinstance(chunks, int):
        values = init
        for c in range(chunks):
            values = step(builder.add(start, ir.Constant(I64, 32 * c)), values)
        return values
    slots = [cgutils.alloca_once(builder, v.type) for v in init]
    for v, slot in zip(init, slots):
        builder.store(v, slot)
    with cgutils.for_range(builder, chunks) as c:
        at = builder.add(start, builder.mul(c.index, ir.Constant(I64, 32)))
        for v, slot in zip(step(at, [builder.load(slot) for slot in slots]), slots):
            builder.store(v, slot)
    return [builder.load(slot) for slot in slots]


def _prefetch_rows(builder, qps, at, n_bytes):
    """Asks for the n_bytes from element at of each row into L2 (prefetcht2), a
    64-byte line at a time."""
    prefetch = _declare(builder, "llvm.prefetch.p0i8", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    for line in range(0, n_bytes, 64):
        for qp in qps:
            address = builder.gep(qp, [builder.add(at, ir.Constant(I64, line))])
            builder.call(prefetch, [address, ir.Constant(I32, 0), ir.Constant(I32, 1), ir.Constant(I32, 1)])


def _emit_rows(builder, qps, sps, xsp, n_groups, gs, ahead, group_dots, unrolled, mins=None):
    """The ROWS rows' dot products (float32 values; see the section comment).
    qps, sps: each row's weights and fp16 scales; xsp: the activation scales;
    ahead: how many bytes further on each row to prefetch (0: no prefetch; gs
    32, 64 and 128 only); group_dots(g, start, chunks): the ROWS rows' int32
    lanes (8 each) of group g, at element offset start = g gs of the
    activations, of `chunks` chunks (see _fold_chunks). mins: int4's minimum
    term, (each row's fp16 minima, the activations' group sums): row i adds
    sum_g m[i, g] xsum[g], and its weights are nibbles, gs / 2 bytes a group."""
    fma = _declare(builder, "llvm.fma.v8f32", FLOATS8, [FLOATS8] * 3)
    acc = [[cgutils.alloca_once_value(builder, ir.Constant(FLOATS8, None)) for _ in range(ROWS)]
           for _ in range(2)]
    buf = cgutils.alloca_once(builder, F32, size=ROWS * 8)        # a block's scales, [ROWS, 8]
    n_blocks = builder.lshr(n_groups, ir.Constant(I64, 3))

    per_byte = 1 if mins is None else 2               # weights per byte
    minimum = [] if mins is None else [acc[1][i] for i in range(ROWS)]   # where row i's minimum terms go

    def add_group(g, scales, slots, chunks):       # slots[i] += float(row i's int32 lanes of group g) * scales[i]
        dots = group_dots(g, builder.mul(g, gs), chunks)
        for d, scale, slot in zip(dots, scales, slots):
            lanes = builder.sitofp(d, FLOATS8)
            builder.store(builder.call(fma, [lanes, _splat(builder, scale), builder.load(slot)]), slot)

    def emit(chunks):
        with cgutils.for_range(builder, n_blocks) as block:              # 8 groups
            g0 = builder.shl(block.index, ir.Constant(I64, 3))
            if isinstance(chunks, int):                                  # the block's bytes, `ahead` further on
                with builder.if_then(builder.icmp_unsigned("!=", ahead, ir.Constant(I64, 0))):
                    at = builder.udiv(builder.mul(g0, gs), ir.Constant(I64, per_byte))
                    _prefetch_rows(builder, qps, builder.add(at, ahead), 8 * 32 * chunks // per_byte)
            xs8 = _load8(builder, xsp, g0)
            for i, sp in enumerate(sps):
                s8 = builder.fmul(_halves8(builder, sp, g0), xs8)
                builder.store(s8, builder.bitcast(builder.gep(buf, [ir.Constant(I64, 8 * i)]), FLOATS8.as_pointer()),
                              align=4)
            if mins is not None:                                         # 8 groups' m xsum, added to the lanes
                xsum8 = _load8(builder, mins[1], g0)
                for mp, slot in zip(mins[0], minimum):
                    builder.store(builder.call(fma, [_halves8(builder, mp, g0), xsum8, builder.load(slot)]), slot)
            with cgutils.for_range(builder, ir.Constant(I64, 4)) as pair:   # groups 2p, 2p + 1 of the block
                for j in range(2):
                    k = builder.add(builder.shl(pair.index, ir.Constant(I64, 1)), ir.Constant(I64, j))
                    scales = [builder.load(builder.gep(buf, [builder.add(ir.Constant(I64, 8 * i), k)]))
                              for i in range(ROWS)]
                    add_group(builder.add(g0, k), scales, acc[j], chunks)
        with cgutils.for_range_slice(builder, builder.shl(n_blocks, ir.Constant(I64, 3)), n_groups,
                                     ir.Constant(I64, 1)) as (g, _):    # the last n_groups % 8, one at a time
            add_group(g, [_scale(builder, sp, xsp, g) for sp in sps], acc[0], chunks)
            if mins is not None:
                xsum = builder.load(builder.gep(mins[1], [g]))
                for mp, slot in zip(mins[0], minimum):               # in lane 0
                    term = builder.insert_element(ir.Constant(FLOATS8, None),
                                                  builder.fmul(_half(builder, mp, g), xsum), ir.Constant(I32, 0))
                    builder.store(builder.fadd(builder.load(slot), term), slot)

    _by_group_size(builder, gs, emit, unrolled)
    total = _declare(builder, "llvm.vector.reduce.fadd.v8f32", F32, [F32, FLOATS8])
    return [builder.call(total, [ir.Constant(F32, 0.0), builder.fadd(builder.load(a), builder.load(b))],
                         fastmath=("reassoc",)) for a, b in zip(*acc)]


def _rows_setup(context, builder, signature, vals, qi, si, per_byte=1):
    """What the rows kernels need from their arguments (vals: widened by
    _as_int64): q, qoff, row_stride at qi, qi + 1, qi + 2, and s, soff, xs, xsoff,
    n_groups, gs, out, ooff, n_rows from si on (per_byte: weights per byte of q).
    Returns the rows' weight and scale pointers, the activation scales', the
    prefetch distance in bytes (0: none), store(sums), which writes the results,
    and like(array index), the rows' pointers into an array laid out as s."""
    ty = signature.args
    q_, qoff_, stride_ = vals[qi:qi + 3]
    s_, soff_, xs_, xsoff_, n_groups_, gs_, out_, ooff_, n_rows_ = vals[si:si + 9]
    m = _rows_apart(builder, stride_, n_groups_, builder.udiv(gs_, ir.Constant(I64, per_byte)))
    qps = _rows_pointers(builder, _base(context, builder, ty[qi], q_, I8), qoff_, stride_, n_rows_)

    def like(k):                                         # array k, laid out as s: [O, n_groups] fp16 bits
        return _rows_pointers(builder, _base(context, builder, ty[k], vals[k], I16), soff_,
                              builder.mul(m, n_groups_), n_rows_)

    sps = like(si)
    xsp = builder.gep(_base(context, builder, ty[si + 2], xs_, F32), [xsoff_])
    outp = builder.gep(_base(context, builder, ty[si + 6], out_, F32), [ooff_])
    # adjacent rows: prefetch the next call's 4 rows (see the section comment)
    adjacent = builder.icmp_unsigned("==", m, ir.Constant(I64, 1))
    ahead = builder.select(adjacent, builder.mul(stride_, ir.Constant(I64, ROWS)), ir.Constant(I64, 0))

    def store(sums):                                     # out[ooff + i m] = sums[i] for i < n_rows
        for i, v in enumerate(sums):
            with builder.if_then(builder.icmp_signed("<", ir.Constant(I64, i), n_rows_)):
                builder.store(v, builder.gep(outp, [builder.mul(ir.Constant(I64, i), m)]))

    return qps, sps, xsp, ahead, store, like


@intrinsic
def dot_int8_rows(typingctx, q, qoff, row_stride, xq, xa, xoff, s, soff, xs, xsoff, n_groups, gs, out, ooff,
                  n_rows, gs_chunks):
    """dot_int8_row for n_rows <= 4 rows at once (see the section comment): for i < n_rows,

        out[ooff + i m] = sum_g s[soff + i m n_groups + g] * xs[xsoff + g]
                            * sum_j q[qoff + i row_stride + g gs + j] * xq[xoff + g gs + j]

    with m = max(1, row_stride // (n_groups gs)): the call's rows are rows of one
    [O, G, gs] matrix, m rows apart (m = 1, adjacent rows: row_stride = G gs, the
    scales and outputs of row i at i * n_groups and i). Arguments as in
    dot_int8_row, plus row_stride (elements of q between the call's rows), out
    (float32) and n_rows; rows i >= n_rows are neither read nor written. xa (|xq|)
    is read on AVX2 only (no q + 128 trick there: vpmaddubsw would saturate)."""
    sig = types.void(q, qoff, row_stride, xq, xa, xoff, s, soff, xs, xsoff, n_groups, gs, out, ooff, n_rows, gs_chunks)

    def codegen(context, builder, signature, args):
        vals = _as_int64(context, builder, signature, args)
        qps, sps, xsp, ahead, store, _ = _rows_setup(context, builder, signature, vals, 0, 6)
        xq_, xoff_, n_groups_, gs_ = vals[3], vals[5], vals[10], vals[11]
        xp = builder.gep(_base(context, builder, signature.args[3], xq_, I8), [xoff_])
        bias = ir.Constant(BYTES32, [128] * 32)
        zero = ir.Constant(INTS8, None)
        if not VNNI:
            # AVX2: vpmaddubsw saturates at 2 * 255 * 127, so no (q + 128) trick: |xq| against
            # q * sign(xq) (vpsignb per row), as dot_int8_row does; both stay within 127
            ap = builder.gep(_base(context, builder, signature.args[4], vals[4], I8), [xoff_])
            psign = _declare(builder, "llvm.x86.avx2.psign.b", BYTES32, [BYTES32, BYTES32])

            def group_dots(g, start, chunks):
                return _fold_chunks(builder, chunks, start, [zero] * ROWS, lambda at, dots: [
                    _vpdpbusd(builder, _load32(builder, ap, at),
                              builder.call(psign, [_load32(builder, qp, at), _load32(builder, xp, at)]), d)
                    for qp, d in zip(qps, dots)])

            store(_emit_rows(builder, qps, sps, xsp, n_groups_, gs_, ahead, group_dots, len(signature.args[-1])))
            return context.get_dummy_value()

        def group_dots(g, start, chunks):
            # (q + 128) . xq - 128 sum(xq): the correction is the activations' alone, shared by the rows
            corr = _fold_chunks(builder, chunks, start, [zero],
                                lambda at, v: [_vpdpbusd(builder, bias, _load32(builder, xp, at), v[0])])[0]
            return _fold_chunks(builder, chunks, start, [builder.sub(zero, corr)] * ROWS, lambda at, dots: [
                _vpdpbusd(builder, builder.xor(_load32(builder, qp, at), bias), _load32(builder, xp, at), d)
                for qp, d in zip(qps, dots)])

        store(_emit_rows(builder, qps, sps, xsp, n_groups_, gs_, ahead, group_dots, len(signature.args[-1])))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def dot_int8_rows_i16(typingctx, q, qoff, row_stride, x16, xoff, s, soff, xs, xsoff, n_groups, gs, out, ooff,
                      n_rows, gs_chunks):
    """dot_int8_row_i16 for n_rows <= 4 rows at once: dot_int8_rows (same rows,
    strides and outputs) with int16 activations x16, two vpdpwssd per row and
    chunk, the weights widened by vpmovsxbw. No overflow: a lane adds 4 products
    |q x16| <= 127 * 32767 per chunk, so gs up to 4096."""
    sig = types.void(q, qoff, row_stride, x16, xoff, s, soff, xs, xsoff, n_groups, gs, out, ooff, n_rows, gs_chunks)

    def codegen(context, builder, signature, args):
        vals = _as_int64(context, builder, signature, args)
        qps, sps, xsp, ahead, store, _ = _rows_setup(context, builder, signature, vals, 0, 5)
        x16_, xoff_, n_groups_, gs_ = vals[3], vals[4], vals[9], vals[10]
        xp = builder.gep(_base(context, builder, signature.args[3], x16_, I16), [xoff_])
        bytes16, shorts16 = ir.VectorType(I8, 16), ir.VectorType(I16, 16)

        def chunk(at, dots):
            dots = list(dots)
            for half in range(2):                                 # 16 weights each, the activations shared
                h = builder.add(at, ir.Constant(I64, 16 * half))
                x = builder.load(builder.bitcast(builder.gep(xp, [h]), shorts16.as_pointer()), align=2)
                for i, qp in enumerate(qps):
                    w = builder.load(builder.bitcast(builder.gep(qp, [h]), bytes16.as_pointer()), align=1)
                    dots[i] = _vpdpwssd(builder, dots[i], builder.sext(w, shorts16), x)
            return dots

        def group_dots(g, start, chunks):
            return _fold_chunks(builder, chunks, start, [ir.Constant(INTS8, None)] * ROWS, chunk)

        store(_emit_rows(builder, qps, sps, xsp, n_groups_, gs_, ahead, group_dots, len(signature.args[-1])))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def dot_int4_rows(typingctx, q, qoff, row_stride, xq, xoff, s, soff, xs, xsoff, n_groups, gs, out, ooff, n_rows,
                  m, xsum, gs_chunks):
    """The rows kernel of int4 weights and int8 activations: for i < n_rows,

        out[ooff + i k] = sum_g s[soff + i k G + g] * xs[xsoff + g] * (nibbles[i, g] . xq[xoff + g gs ..])
                                + m[soff + i k G + g] * xsum[xsoff + g]

    (G = n_groups). q holds the bytes of kernels.matmul_int4's [O, G/2, gs] layout:
    group 2p is the low nibbles of pair p's gs bytes, group 2p+1 the high ones.
    row_stride: bytes of q between the call's rows, k = max(1, row_stride // (G gs / 2))
    rows apart as in dot_int8_rows, whose other arguments these are; m: the fp16
    minima, laid out as s; xsum: each group's sum of the rounded activations
    (kernels.quantize_activations). A nibble (0..15) is unsigned, so vpdpbusd (or
    vpmaddubsw, whose pair sums 2 * 15 * 127 stay far from saturation) takes it
    against xq as it is: no sign trick, no correction."""
    sig = types.void(q, qoff, row_stride, xq, xoff, s, soff, xs, xsoff, n_groups, gs, out, ooff, n_rows, m, xsum,
                     gs_chunks)

    def codegen(context, builder, signature, args):
        vals = _as_int64(context, builder, signature, args)
        qps, sps, xsp, ahead, store, like = _rows_setup(context, builder, signature, vals, 0, 5, per_byte=2)
        xq_, xoff_, xsoff_, gs_ = vals[3], vals[4], vals[8], vals[10]
        xp = builder.gep(_base(context, builder, signature.args[3], xq_, I8), [xoff_])
        xsump = builder.gep(_base(context, builder, signature.args[15], vals[15], F32), [xsoff_])
        low4, four = ir.Constant(BYTES32, [15] * 32), ir.Constant(BYTES32, [4] * 32)
        zero = ir.Constant(INTS8, None)

        def group_dots(g, start, chunks):
            odd = builder.trunc(g, ir.IntType(1))        # a constant in the unrolled blocks (LLVM sees g0 + 2p + j)
            to_q = builder.sub(builder.mul(builder.lshr(g, ir.Constant(I64, 1)), gs_), start)   # pair's bytes - start

            def chunk(at, dots):
                x = _load32(builder, xp, at)                                     # shared by the rows
                out = []
                for qp, d in zip(qps, dots):
                    b = _load32(builder, qp, builder.add(at, to_q))
                    nibbles = builder.select(odd, builder.lshr(b, four), builder.and_(b, low4))
                    out.append(_vpdpbusd(builder, nibbles, x, d))
                return out

            return _fold_chunks(builder, chunks, start, [zero] * ROWS, chunk)

        store(_emit_rows(builder, qps, sps, xsp, vals[9], gs_, ahead, group_dots, len(signature.args[-1]),
                             mins=(like(14), xsump)))
        return context.get_dummy_value()

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
