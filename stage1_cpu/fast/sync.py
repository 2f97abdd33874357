"""Threads that share a parallel region and hand work to each other: atomic counters.

Why: a decode step is ~110 matmuls in a row, each needing the previous one's
output. Run as one numba prange kernel each, every matmul starts its threads
anew, and under OMP_WAIT_POLICY=PASSIVE (sleeping idle threads, what the
benchmark and a shared machine want) a start costs tens of microseconds: milliseconds
per token, a large part of an int8 decode step on a small machine (docs/benchmarks.md).
decode_step.py instead starts the threads once per token and keeps them inside;
what the threads then need is a way to split each matmul between them and to wait
for each other. That is this module: a counter per phase of work, incremented
atomically.

    i = claim(sync, p)                   # the next unclaimed item of phase p
    while i < n:
        ... item i ...                   # e.g. 64 rows of a matmul
        finish(sync, p)                  # one more item of phase p is done
        i = claim(sync, p)
    wait(sync, p, n)                     # until all n items are done, by anyone

Items are claimed, not assigned, so nothing depends on how many threads run or
when they start: a thread that wakes late simply finds fewer items left (the
first one does not wait for it), and a single thread running the iterations one
after another does all the work in the first and finds nothing left in the
others. No thread ever waits for an item that nobody is working on, so it
cannot deadlock. Waiting spins (the pause instruction), which is right for the
microseconds a phase's last item takes; the threads sleep again when the region
ends, between tokens.

numba has no atomic operations for CPU code, so the two below are written in
LLVM IR (llvmlite), like simd.py's instructions.
"""
from __future__ import annotations

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

SLOT = 8                                  # int64s per counter: one 64-byte cache line each
_X86 = llvm.get_default_triple().startswith(("x86_64", "i686", "i386"))


def counters(n_phases: int) -> np.ndarray:
    """Zeroed counters for n_phases phases: claimed and done, each on its own cache line."""
    return np.zeros(n_phases * 2 * SLOT, dtype=np.int64)


@intrinsic
def atomic_add(typingctx, counts, index, value):
    """counts[index] += value, atomically; returns the value before (int64)."""
    sig = types.int64(counts, index, value)

    def codegen(context, builder, signature, args):
        counts_, index_, value_ = args
        ptr = cgutils.get_item_pointer(
            context, builder, signature.args[0],
            context.make_array(signature.args[0])(context, builder, counts_),
            [index_], wraparound=False)
        value_ = context.cast(builder, value_, signature.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, value_, "seq_cst")

    return sig, codegen


@intrinsic
def atomic_load(typingctx, counts, index):
    """counts[index], read atomically (no load or store after it moves before it)."""
    sig = types.int64(counts, index)

    def codegen(context, builder, signature, args):
        counts_, index_ = args
        ptr = cgutils.get_item_pointer(
            context, builder, signature.args[0],
            context.make_array(signature.args[0])(context, builder, counts_),
            [index_], wraparound=False)
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def nap(typingctx, microseconds):
    """Sleep (libc usleep): gives the core to a thread the OS has waiting for one."""
    sig = types.void(microseconds)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module,
                                            ir.FunctionType(ir.IntType(32), [ir.IntType(32)]),
                                            "usleep")
        builder.call(fn, [builder.trunc(args[0], ir.IntType(32))])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def pause(typingctx):
    """The spin-wait hint (x86 `pause`): lets the other hyperthread run, saves power."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


_inline = njit(inline="always")


@_inline
def claim(sync, phase):
    """The next unclaimed item of phase (0, 1, 2, ...; past the last once all are taken)."""
    return atomic_add(sync, 2 * SLOT * phase, 1)


@_inline
def finish(sync, phase):
    """One more item of phase is done (its results are written before this)."""
    atomic_add(sync, 2 * SLOT * phase + SLOT, 1)


SPINS = 1000                              # pauses before a wait starts napping (a few to tens of us
                                          # in all: pause's latency varies by CPU model)


@_inline
def wait(sync, phase, n):
    """Until all n items of phase are done (their results are visible after this): spin
    (a phase's last item takes microseconds), then nap in 20 us steps (the item's thread
    may be off its core, and spinning would keep it off this one)."""
    spins = 0
    while atomic_load(sync, 2 * SLOT * phase + SLOT) < n:
        if spins < SPINS:
            pause()
            spins += 1
        else:
            nap(20)
