"""A small emulator of the CUDA execution model, for running the .cu sources on a CPU.

Each .cu file is compiled as C++20 by g++ together with EMULATOR_H below; each CUDA
thread of a block is an OS thread. What it models, and the bugs each part catches:

- blocks of a grid run in a seeded, shuffled order, 2 to 4 of them live at once: a
  kernel whose blocks depend on one another (block b reads what block b-1 wrote) gives
  different answers from run to run, as on a GPU, instead of the in-order answer;
- `__shared__` memory belongs to its block and is poisoned (every byte 0xFF: a float
  NaN, an int -1) when the block starts: a read of shared memory that no thread of the
  block wrote shows up as NaN instead of a lucky zero or the previous block's data;
- shared memory as CUDA counts it: a kernel's static `__shared__` variables (all of them,
  summed at build time as ptxas does, whether or not a launch touches them) and the
  launch's dynamic part (`extern __shared__`) share 48 KB unless the kernel's
  max_dynamic_shared_size_bytes attribute is raised (as in CuPy); raised, the static part
  plus the attribute stays within the target's opt-in limit (227 KB on sm_90, 163 KB on sm_80);
- dynamic shared memory is only as aligned as its declaration asks (the element type's
  alignment, or `__align__(N)`), and a load or store the compiler emits as aligned at an
  address that is not (a uint4 from a 2-byte-aligned array) fails the launch, as the GPU's
  misaligned-address error does (with the race detector's instrumentation: QS_EMU_RACE);
- launches check blockDim (at most 1024 threads, z at most 64) and the grid (x < 2^31,
  y and z at most 65535);
- `__syncthreads()` is a barrier that every thread of the block must reach at the same
  call: threads that exited early, or that wait at another `__syncthreads`, are an error
  that names the line;
- warp shuffles (`__shfl_xor_sync`, `_down_`, `_up_`, `__shfl_sync`, `__syncwarp`)
  exchange values among exactly the lanes of their mask: a lane that calls with a mask
  that leaves itself out, reads a lane outside the mask, or names lanes that do not
  exist or have exited, is an error;
- a watchdog turns a deadlock (threads that wait for one another, no progress for
  QS_EMU_WATCHDOG_S seconds, default 20) into an error that says who waits where;
- a race detector between the blocks of a launch: a byte of a pointer argument that one
  block writes and another block writes or reads (outside atomics) fails the launch with
  both blocks and the element. The sources are compiled with GCC's ThreadSanitizer
  instrumentation (-fsanitize=thread) and linked without libtsan: EMULATOR_H defines the
  __tsan_* entry points, so every load and store of kernel code, whatever pointer arithmetic
  or cast made its address, reaches a shadow of the launch's arguments (per byte: the block
  that wrote it, the block(s) that read it). It sees every such conflict of the launch, not
  only between blocks that happened to run at the same time. It cannot see races between
  threads of one block (the barrier and shuffle checks are for those), addresses outside
  the pointer arguments (out of bounds is memcheck's), atomic and plain accesses mixed on one
  address (atomics are not recorded), or conflicts between launches (a stream orders them).
  On by default; QS_EMU_RACE=0 builds and runs without it.

Every error fails the launch with a message that carries the seed: QS_EMU_SEED=S replays
the same block orders (the seed of each launch is derived from S and the launch's number
in the process). What it cannot catch: races between threads of one block that happen to
run in a benign order on the CPU, the GPU's memory model, warp-synchronous code without *_sync,
performance. Busy-waiting kernel code (a spin on global memory) is not interrupted by
the watchdog; pytest-timeout's thread method is the backstop there.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import types
import weakref
from pathlib import Path

import numpy as np

from .cuda_sources import OPTIN_SMEM_LIMIT, STATIC_SMEM_LIMIT

SEED = int(os.environ.get("QS_EMU_SEED") or random.SystemRandom().randrange(2**31))
WATCHDOG_S = float(os.environ.get("QS_EMU_WATCHDOG_S", "20"))
# the race detector between blocks (on unless QS_EMU_RACE=0): see the module docstring
RACE = os.environ.get("QS_EMU_RACE", "1") != "0"
TARGET = os.environ.get("QS_EMU_TARGET", "sm_90")
DEFAULT_DYNAMIC_SMEM = 48 * 1024          # what a kernel may use before it raises its attribute
MAX_THREADS, MAX_BLOCK = 1024, (1024, 1024, 64)
MAX_GRID = (2**31 - 1, 65535, 65535)
_launch_number = itertools.count()


class EmulatorError(AssertionError):
    """A launch the GPU would refuse, or a kernel bug the emulator caught."""


EMULATOR_H = r"""
// --- the CUDA execution model on CPU threads (bench/testbed/cuda_emulator.py) ---
#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csetjmp>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

struct Dim3 { unsigned x = 1, y = 1, z = 1; };
static thread_local Dim3 threadIdx, blockIdx;
static Dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
using std::min;
using std::max;

namespace qs {
struct Abort {};                                   // unwinds a thread after an error

struct LaunchArgs {                                // mirrored by LaunchArgs in cuda_emulator.py
    unsigned gx, gy, gz, bx, by, bz;
    unsigned long long dynamic_smem, seed;
    int live;
    double watchdog_s;
    unsigned long long optin_smem, static_smem_limit;
    int race;                                      // 1: the race detector watches this launch
    int nranges;
    const unsigned long long* ranges;              // [nranges, 2]: each pointer argument's [lo, hi)
};

// the race detector's shadow of one pointer argument: per byte, the block (number + 1) that
// wrote it, and the block that read it (MANY once two blocks have)
struct Shadow {
    unsigned long long lo = 0, hi = 0;
    unsigned* writer = nullptr;
    unsigned* reader = nullptr;
};
constexpr unsigned MANY = 0xffffffffu;

struct Launch {
    LaunchArgs a;
    std::mutex mu;
    std::atomic<bool> aborted{false};
    std::string error;
    std::vector<Shadow> shadows;
    // shadows.data(), for the hooks (plain pointers only)
    Shadow* shadow = nullptr;
    int nshadow = 0;
};
static Launch* launch_state = nullptr;

struct Warp {
    unsigned existing = 0, exited = 0;             // lane bit masks
    unsigned mask = 0, arrived = 0, readers = 0, round = 0;
    bool reading = false;
    int line = 0;
    const char* what = "";
    unsigned long long value[32];
    std::condition_variable cv;                    // its shuffles wait here, not on the block's
};

struct Block {
    Dim3 idx;
    unsigned nthreads = 0;
    std::mutex mu;
    std::condition_variable cv;
    unsigned arrived = 0, exited = 0, generation = 0;
    int line = -1;
    std::unique_ptr<Warp[]> warps;
    unsigned nwarps = 0;
    std::map<int, std::unique_ptr<unsigned char[]>> statics;
    unsigned long long static_bytes = 0;
    struct Aligned {
        void operator()(unsigned char* p) const { ::operator delete[](p, std::align_val_t(64)); }
    };
    std::unique_ptr<unsigned char[], Aligned> dynamic;
};
static thread_local Block* cur = nullptr;
static thread_local std::jmp_buf escape;           // a way out of a kernel that cannot unwind
static thread_local unsigned tid = 0;              // linear thread index in the block

inline std::string fmt(const char* f, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

inline std::string where() {
    return fmt("block (%u,%u,%u) thread (%u,%u,%u)", blockIdx.x, blockIdx.y, blockIdx.z,
               threadIdx.x, threadIdx.y, threadIdx.z);
}

inline void record(const std::string& msg) {       // the first error of the launch wins
    std::lock_guard<std::mutex> g(launch_state->mu);
    if (!launch_state->aborted) {
        launch_state->error = msg;
        launch_state->aborted = true;
    }
}

[[noreturn]] inline void fail(const std::string& msg) {
    record(msg);
    throw Abort{};
}

// wait on cv (the block's, or a warp's for its shuffles) until done(); the watchdog fails the
// launch when nothing changes for watchdog_s seconds, another thread's error ends the wait
template <class Done, class Describe>
void wait(std::unique_lock<std::mutex>& lk, std::condition_variable& cv, Done done,
          Describe describe) {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration<double>(launch_state->a.watchdog_s);
    while (!done()) {
        if (launch_state->aborted) throw Abort{};
        if (std::chrono::steady_clock::now() >= deadline) {
            fail(fmt("watchdog: no progress for %.0f s, a deadlock: %s waits %s",
                     launch_state->a.watchdog_s, where().c_str(), describe().c_str()));
        }
        cv.wait_for(lk, std::chrono::milliseconds(20));
    }
}

inline std::string divergent(const Block& b) {
    return fmt("block (%u,%u,%u): %u of %u threads reached __syncthreads() at line %d and %u "
               "exited before it: every thread of the block must reach each barrier (on the GPU: "
               "a hang or garbage)", b.idx.x, b.idx.y, b.idx.z, b.arrived, b.nthreads, b.line,
               b.exited);
}

inline void syncthreads(int line) {
    Block& b = *cur;
    std::unique_lock<std::mutex> lk(b.mu);
    if (b.arrived == 0) {
        b.line = line;
    } else if (b.line != line) {
        fail(fmt("%s: threads of one block wait at different __syncthreads() "
                 "(line %d and line %d): a barrier inside a branch that not every thread takes",
                 where().c_str(), b.line, line));
    }
    b.arrived++;
    if (b.arrived + b.exited == b.nthreads) {
        if (b.exited) fail(divergent(b));
        b.arrived = 0;
        b.generation++;
        b.cv.notify_all();
        return;
    }
    const unsigned gen = b.generation;
    wait(lk, b.cv, [&] { return b.generation != gen; }, [&] {
        return fmt("at __syncthreads() line %d: %u of %u threads there, %u exited", line, b.arrived,
                   b.nthreads, b.exited);
    });
}

inline void thread_exit() {
    Block& b = *cur;
    std::unique_lock<std::mutex> lk(b.mu);
    const unsigned lane = tid % 32;
    Warp& w = b.warps[tid / 32];
    b.exited++;
    w.exited |= 1u << lane;
    b.cv.notify_all();
    w.cv.notify_all();
    if (b.arrived > 0 && b.arrived + b.exited == b.nthreads) fail(divergent(b));
    if (w.arrived && !w.reading && ((w.mask >> lane) & 1u) && !((w.arrived >> lane) & 1u)) {
        fail(fmt("%s exited while lanes 0x%08x of its warp wait for it in %s at line %d "
                 "(mask 0x%08x)", where().c_str(), w.arrived, w.what, w.line, w.mask));
    }
}

enum Kind { XOR, DOWN, UP, IDX };

// a warp shuffle among exactly the lanes of `mask`
template <class T>
T shfl(int line, const char* what, Kind kind, unsigned mask, T v, int arg, int width) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 8 bytes");
    Block& b = *cur;
    const unsigned lane = tid % 32, wi = tid / 32;
    Warp& w = b.warps[wi];
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail(fmt("%s: %s at line %d with width %d (a power of 2 up to 32)", where().c_str(), what,
                 line, width));
    const int seg = lane & ~(width - 1);
    int src = lane;
    switch (kind) {
        case XOR: src = lane ^ arg; if (src < seg || src >= seg + width) src = lane; break;
        case DOWN: src = lane + arg; if (src >= seg + width) src = lane; break;
        case UP: src = lane - arg; if (src < seg) src = lane; break;
        case IDX: src = seg + (arg & (width - 1)); break;
    }
    std::unique_lock<std::mutex> lk(b.mu);
    if (!((mask >> lane) & 1u))
        fail(fmt("%s (lane %u of warp %u) calls %s at line %d with mask 0x%08x, which leaves out "
                 "the calling lane", where().c_str(), lane, wi, what, line, mask));
    if (mask & ~w.existing)
        fail(fmt("%s: %s at line %d with mask 0x%08x names lanes that do not exist "
                 "(this warp has 0x%08x)", where().c_str(), what, line, mask, w.existing));
    if (!((mask >> src) & 1u))
        fail(fmt("%s (lane %u) reads lane %d in %s at line %d, outside the mask 0x%08x "
                 "(undefined on the GPU)", where().c_str(), lane, src, what, line, mask));
    wait(lk, w.cv, [&] { return !w.reading; },
         [&] { return fmt("to enter %s at line %d", what, line); });
    if (w.arrived == 0) {
        w.mask = mask;
        w.line = line;
        w.what = what;
    } else if (w.mask != mask || w.line != line) {
        fail(fmt("%s: lanes of warp %u meet in different shuffles: mask 0x%08x at line %d and "
                 "mask 0x%08x at line %d", where().c_str(), wi, w.mask, w.line, mask, line));
    }
    if (mask & w.exited)
        fail(fmt("%s: %s at line %d with mask 0x%08x, but lanes 0x%08x have exited",
                 where().c_str(), what, line, mask, mask & w.exited));
    std::memcpy(&w.value[lane], &v, sizeof(T));
    w.arrived |= 1u << lane;
    const unsigned round = w.round;
    if (w.arrived == mask) {
        w.reading = true;
        w.readers = std::popcount(mask);
        w.cv.notify_all();
    } else {
        wait(lk, w.cv, [&] { return w.reading && w.round == round; }, [&] {
            return fmt("in %s at line %d (mask 0x%08x): lanes 0x%08x arrived", what, line, mask,
                       w.arrived);
        });
    }
    T out;
    std::memcpy(&out, &w.value[src], sizeof(T));
    if (--w.readers == 0) {
        w.reading = false;
        w.arrived = 0;
        w.round++;
        w.cv.notify_all();
    }
    return out;
}

// a block's own __shared__ variable, poisoned (0xFF bytes) at its first use in the block
inline void* shared(int id, unsigned long long size, const char* name, int line) {
    Block& b = *cur;
    std::lock_guard<std::mutex> g(b.mu);
    auto it = b.statics.find(id);
    if (it != b.statics.end()) return it->second.get();
    b.static_bytes += size;
    const auto& a = launch_state->a;
    if (b.static_bytes > a.static_smem_limit)
        fail(fmt("%s: static __shared__ memory reaches %llu bytes with '%s' (line %d), over the "
                 "%llu bytes a block may have; use extern __shared__ and raise "
                 "max_dynamic_shared_size_bytes",
                 where().c_str(), b.static_bytes, name, line, a.static_smem_limit));
    if (b.static_bytes + a.dynamic_smem > a.optin_smem)
        fail(fmt("%s: %llu bytes of static + %llu of dynamic shared memory, over the target's "
                 "opt-in limit of %llu", where().c_str(), b.static_bytes, a.dynamic_smem,
                 a.optin_smem));
    auto mem = std::make_unique<unsigned char[]>(size + 16);
    std::memset(mem.get(), 0xFF, size + 16);
    void* p = mem.get();
    b.statics[id] = std::move(mem);
    return p;
}

// the launch's dynamic shared memory, at an address aligned to `align` (what the file's
// extern __shared__ declarations ask for) and to nothing more: a 16-byte access through an
// array declared with the alignment of its element type is misaligned here, as CUDA allows it
// to be on the GPU (the region starts after the static variables, aligned as declared)
inline void* dynamic_shared(unsigned long long align) {
    if (!cur->dynamic)
        fail(fmt("%s: extern __shared__ memory used, but the launch gave 0 bytes of it",
                 where().c_str()));
    return cur->dynamic.get() + (align < 64 ? align : 0);
}

inline void setup_block(Block& b, unsigned long long i) {
    const auto& a = launch_state->a;
    b.idx = {unsigned(i % a.gx), unsigned((i / a.gx) % a.gy),
             unsigned(i / ((unsigned long long)a.gx * a.gy))};
    b.nthreads = a.bx * a.by * a.bz;
    b.nwarps = (b.nthreads + 31) / 32;
    b.warps = std::make_unique<Warp[]>(b.nwarps);
    for (unsigned w = 0; w < b.nwarps; w++) {
        const unsigned n = std::min(32u, b.nthreads - 32 * w);
        b.warps[w].existing = n == 32 ? 0xffffffffu : (1u << n) - 1;
    }
    if (a.dynamic_smem) {
        b.dynamic.reset(new (std::align_val_t(64)) unsigned char[a.dynamic_smem + 64]);
        std::memset(b.dynamic.get(), 0xFF, a.dynamic_smem + 64);
    }
}

// one of a launch's `live` slots: a team of blockDim OS threads, started once per launch,
// runs block after block, each a fresh Block (its shared memory poisoned anew). Starting and
// joining a thread costs tens of microseconds (63 under gVisor: 8 ms for a block of 128),
// paid per launch here instead of per block.
template <class Body>
void run_slot(Body& body, std::atomic<unsigned long long>& next,
              const std::vector<unsigned long long>& order) {
    const auto& a = launch_state->a;
    const unsigned nthreads = a.bx * a.by * a.bz;
    std::mutex mu;
    std::condition_variable start, finished;
    std::unique_ptr<Block> block;
    // the team's block count: a new one starts the team
    unsigned long long round = 0;
    unsigned running = 0;
    bool stop = false;
    std::vector<std::thread> team;
    team.reserve(nthreads);
    for (unsigned t = 0; t < nthreads; t++) {
        team.emplace_back([&, t] {
            unsigned long long seen = 0;
            for (;;) {
                Block* b;
                {
                    std::unique_lock<std::mutex> lk(mu);
                    start.wait(lk, [&] { return stop || round != seen; });
                    if (stop) return;
                    seen = round;
                    b = block.get();
                }
                cur = b;
                tid = t;
                threadIdx = {t % a.bx, (t / a.bx) % a.by, t / (a.bx * a.by)};
                blockIdx = b->idx;
                if (setjmp(escape) == 0) {             // (a misaligned access jumps back here)
                    try {
                        body();
                        thread_exit();
                    } catch (Abort&) {
                    } catch (std::exception& e) {
                        record(where() + ": " + e.what());
                    }
                }
                {
                    std::lock_guard<std::mutex> g(b->mu);   // wake the others, who see the abort
                    b->cv.notify_all();
                }
                cur = nullptr;
                std::lock_guard<std::mutex> g(mu);
                if (--running == 0) finished.notify_one();
            }
        });
    }
    for (;;) {
        const unsigned long long i = next++;
        if (i >= order.size() || launch_state->aborted) break;
        auto b = std::make_unique<Block>();
        setup_block(*b, order[i]);
        std::unique_lock<std::mutex> lk(mu);
        block = std::move(b);                      // (the team is done with the previous block)
        running = nthreads;
        round++;
        start.notify_all();
        finished.wait(lk, [&] { return running == 0; });
    }
    {
        std::lock_guard<std::mutex> g(mu);
        stop = true;
    }
    start.notify_all();
    for (auto& th : team) th.join();
}

// every block once, in a shuffled order, `live` blocks at a time -> 0, or 1 and the error
template <class Body>
int launch(const LaunchArgs* args, char* err, int errlen, Body body) {
    Launch L;
    L.a = *args;
    if (L.a.race) {
        for (int r = 0; r < L.a.nranges; r++) {
            Shadow sh;
            sh.lo = L.a.ranges[2 * r];
            sh.hi = L.a.ranges[2 * r + 1];
            const size_t n = sh.hi > sh.lo ? sh.hi - sh.lo : 0;
            // zero pages: lazy
            sh.writer = static_cast<unsigned*>(std::calloc(n + 1, sizeof(unsigned)));
            sh.reader = static_cast<unsigned*>(std::calloc(n + 1, sizeof(unsigned)));
            L.shadows.push_back(sh);
        }
        L.shadow = L.shadows.data();
        L.nshadow = int(L.shadows.size());
    }
    launch_state = &L;
    gridDim = {L.a.gx, L.a.gy, L.a.gz};
    blockDim = {L.a.bx, L.a.by, L.a.bz};
    const unsigned long long n = (unsigned long long)L.a.gx * L.a.gy * L.a.gz;
    std::vector<unsigned long long> order(n);
    std::iota(order.begin(), order.end(), 0ull);
    std::mt19937_64 rng(L.a.seed);
    std::shuffle(order.begin(), order.end(), rng);
    std::atomic<unsigned long long> next{0};
    std::vector<std::thread> slots;
    for (int s = 0; s < L.a.live && (unsigned long long)s < n; s++)
        slots.emplace_back([&] { run_slot(body, next, order); });
    for (auto& th : slots) th.join();
    launch_state = nullptr;
    for (auto& sh : L.shadows) {
        std::free(sh.writer);
        std::free(sh.reader);
    }
    if (L.aborted) {
        std::snprintf(err, errlen, "%s", L.error.c_str());
        return 1;
    }
    return 0;
}
// --- the race detector: GCC's ThreadSanitizer instrumentation (-fsanitize=thread) with this
// runtime instead of libtsan's. Every load and store the compiler emits in this file calls
// __tsan_readN / __tsan_writeN with its address; an address inside a pointer argument of the
// launch is checked against the shadow: a byte written by one block and written or read by
// another is a race (blocks of one launch run in no fixed order, and nothing orders them).
// The answer does not depend on which blocks happened to run at the same time. Atomics
// (__tsan_atomic*) are performed and not recorded. These functions are not instrumented
// themselves, and use only __atomic builtins.
#define QS_HOOK extern "C" __attribute__((no_sanitize_thread, visibility("hidden")))

__attribute__((no_sanitize_thread))
inline void race_report(const char* mine, const char* theirs, unsigned other, int arg,
                        unsigned long long byte)
{
    const Launch* L = launch_state;
    const unsigned o = other - 1, gx = L->a.gx, gy = L->a.gy;
    if (L->aborted) return;
    const std::string who = other == MANY ? std::string("other blocks") :
        fmt("block (%u,%u,%u)", o % gx, (o / gx) % gy, o / (gx * gy));
    record(fmt("race: %s %s {arg %d byte %llu}, which %s %s, and nothing orders two blocks of "
               "one launch (on the GPU: a result that depends on the schedule)", where().c_str(),
               mine, arg, byte, who.c_str(), theirs));
}

__attribute__((no_sanitize_thread))
inline void race_access(const void* p, unsigned long long n, bool write)
{
    Launch* L = launch_state;
    if (L == nullptr || !L->a.race || cur == nullptr) return;
    const unsigned long long a = reinterpret_cast<unsigned long long>(p);
    // (nothing here may call an instrumented function)
    for (int r = 0; r < L->nshadow; r++) {
        Shadow& sh = L->shadow[r];
        if (a < sh.lo || a >= sh.hi) continue;
        const unsigned me = 1 + blockIdx.x + L->a.gx * (blockIdx.y + L->a.gy * blockIdx.z);
        const unsigned long long end = a + n < sh.hi ? a + n : sh.hi;
        for (unsigned long long b = a - sh.lo; b < end - sh.lo; b++) {
            if (write) {
                const unsigned w = __atomic_exchange_n(&sh.writer[b], me, __ATOMIC_SEQ_CST);
                const unsigned rd = __atomic_load_n(&sh.reader[b], __ATOMIC_SEQ_CST);
                if (w && w != me) { race_report("writes", "wrote", w, int(r), b); return; }
                if (rd && rd != me) { race_report("writes", "read", rd, int(r), b); return; }
            } else {
                unsigned rd = __atomic_load_n(&sh.reader[b], __ATOMIC_SEQ_CST);
                if (rd == 0 && __atomic_compare_exchange_n(&sh.reader[b], &rd, me, false,
                                                           __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
                } else if (rd != me && rd != MANY) {
                    __atomic_store_n(&sh.reader[b], MANY, __ATOMIC_SEQ_CST);
                }
                const unsigned w = __atomic_load_n(&sh.writer[b], __ATOMIC_SEQ_CST);
                if (w && w != me) { race_report("reads", "wrote", w, int(r), b); return; }
            }
        }
        return;                                     // the first argument that holds the address
    }
}

// an N-byte load or store the compiler emits as aligned (a uint4, a float, ...) at an address
// that is not a multiple of N: on the GPU a misaligned address error (a 16-byte vector load
// from an array declared with 2-byte alignment, say). The access itself would fault on the CPU
// too (an aligned SSE load), and an exception cannot unwind through the instrumented call, so
// the thread jumps back to the start of its block (kernel code holds nothing to release) and
// the launch fails with the error, as with an exception.
__attribute__((no_sanitize_thread)) inline void aligned(const void* p, unsigned long long n)
{
    if (cur == nullptr || reinterpret_cast<unsigned long long>(p) % n == 0) return;
    record(fmt("%s: a %llu-byte access at an address %llu bytes past a multiple of %llu: a "
             "misaligned address on the GPU (declare the array __align__(%llu))",
             where().c_str(), n,
             reinterpret_cast<unsigned long long>(p) % n, n, n));
    std::longjmp(escape, 1);
}
}  // namespace qs

QS_HOOK void __tsan_init() {}
QS_HOOK void __tsan_func_entry(void*) {}
QS_HOOK void __tsan_func_exit() {}
QS_HOOK void __tsan_vptr_update(void**, void*) {}
QS_HOOK void __tsan_vptr_read(void**) {}
QS_HOOK void __tsan_read_range(void* p, unsigned long n) { qs::race_access(p, n, false); }
QS_HOOK void __tsan_write_range(void* p, unsigned long n) { qs::race_access(p, n, true); }
#define QS_RW(N) \
    QS_HOOK void __tsan_read##N(void* p) { qs::aligned(p, N); qs::race_access(p, N, false); } \
    QS_HOOK void __tsan_write##N(void* p) { qs::aligned(p, N); qs::race_access(p, N, true); } \
    QS_HOOK void __tsan_unaligned_read##N(void* p) { qs::race_access(p, N, false); } \
    QS_HOOK void __tsan_unaligned_write##N(void* p) { qs::race_access(p, N, true); } \
    QS_HOOK void __tsan_volatile_read##N(void* p) { qs::race_access(p, N, false); } \
    QS_HOOK void __tsan_volatile_write##N(void* p) { qs::race_access(p, N, true); }
QS_RW(1) QS_RW(2) QS_RW(4) QS_RW(8) QS_RW(16)
// atomics: done, not recorded (the memory order argument is GCC's, the same numbering)
#define QS_ATOMIC(N, T) \
    QS_HOOK T __tsan_atomic##N##_load(const volatile T* a, int) \
        { return __atomic_load_n(a, __ATOMIC_SEQ_CST); } \
    QS_HOOK void __tsan_atomic##N##_store(volatile T* a, T v, int) \
        { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); } \
    QS_HOOK T __tsan_atomic##N##_exchange(volatile T* a, T v, int) \
        { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); } \
    QS_HOOK T __tsan_atomic##N##_fetch_add(volatile T* a, T v, int) \
        { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); } \
    QS_HOOK T __tsan_atomic##N##_fetch_sub(volatile T* a, T v, int) \
        { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); } \
    QS_HOOK T __tsan_atomic##N##_fetch_and(volatile T* a, T v, int) \
        { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); } \
    QS_HOOK T __tsan_atomic##N##_fetch_or(volatile T* a, T v, int) \
        { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); } \
    QS_HOOK T __tsan_atomic##N##_fetch_xor(volatile T* a, T v, int) \
        { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); } \
    QS_HOOK T __tsan_atomic##N##_fetch_nand(volatile T* a, T v, int) \
        { return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST); } \
    QS_HOOK int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* e, T v, int, int) \
        { return __atomic_compare_exchange_n(a, e, v, false, __ATOMIC_SEQ_CST, \
                                             __ATOMIC_SEQ_CST); } \
    QS_HOOK int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* e, T v, int, int) \
        { return __atomic_compare_exchange_n(a, e, v, false, __ATOMIC_SEQ_CST, \
                                             __ATOMIC_SEQ_CST); } \
    QS_HOOK T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T e, T v, int, int) \
        { __atomic_compare_exchange_n(a, &e, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
          return e; }
QS_ATOMIC(8, unsigned char) QS_ATOMIC(16, unsigned short) QS_ATOMIC(32, unsigned)
QS_ATOMIC(64, unsigned long long)
QS_HOOK void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
QS_HOOK void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

#define __syncthreads() qs::syncthreads(__LINE__)
template <class T> T qs_xor(int line, unsigned m, T v, int x, int w = 32) {
    return qs::shfl(line, "__shfl_xor_sync", qs::XOR, m, v, x, w);
}
template <class T> T qs_down(int line, unsigned m, T v, int d, int w = 32) {
    return qs::shfl(line, "__shfl_down_sync", qs::DOWN, m, v, d, w);
}
template <class T> T qs_up(int line, unsigned m, T v, int d, int w = 32) {
    return qs::shfl(line, "__shfl_up_sync", qs::UP, m, v, d, w);
}
template <class T> T qs_idx(int line, unsigned m, T v, int s, int w = 32) {
    return qs::shfl(line, "__shfl_sync", qs::IDX, m, v, s, w);
}
inline void qs_syncwarp(int line, unsigned m = 0xffffffffu) {
    qs::shfl(line, "__syncwarp", qs::IDX, m, 0, int(qs::tid % 32), 32);
}
#define __shfl_xor_sync(...) qs_xor(__LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) qs_down(__LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) qs_up(__LINE__, __VA_ARGS__)
#define __shfl_sync(...) qs_idx(__LINE__, __VA_ARGS__)
#define __syncwarp(...) qs_syncwarp(__LINE__ __VA_OPT__(,) __VA_ARGS__)

// CUDA's vector types, with their alignment (a 16-byte load of a misaligned address is an error on
// the GPU; here the alignment at least keeps the layout of shared memory the same)
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline float __int_as_float(int bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline float __int_as_float(unsigned bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
template <class T> T __ldg(const T* p) { return *p; }
template <class T> T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T> T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
"""


class LaunchArgs(ctypes.Structure):
    _fields_ = [(k, ctypes.c_uint) for k in ("gx", "gy", "gz", "bx", "by", "bz")] + [
        ("dynamic_smem", ctypes.c_ulonglong), ("seed", ctypes.c_ulonglong), ("live", ctypes.c_int),
        ("watchdog_s", ctypes.c_double), ("optin_smem", ctypes.c_ulonglong),
        ("static_smem_limit", ctypes.c_ulonglong), ("race", ctypes.c_int),
        ("nranges", ctypes.c_int), ("ranges", ctypes.POINTER(ctypes.c_ulonglong))]


# ---------------------------------------------------------------------------
# the .cu source as C++: comments blanked, __shared__ made per block
# ---------------------------------------------------------------------------

def strip_comments(src: str) -> str:
    """Comments replaced by spaces, newlines kept (line numbers stay right)."""
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r"//[^\n]*|/\*.*?\*/", blank, src, flags=re.S)


DYNAMIC = re.compile(r"extern\s+__shared__\s+([^;\[]*?)\s*\b(\w+)\s*\[\s*\]\s*;")
STATIC = re.compile(r"__shared__\s+([^;]*);")
DECLARATOR = re.compile(r"^\s*(\w+)\s*((?:\[[^\]]*\])*)\s*$")
FIRST = re.compile(r"^\s*(.*?)\s*\b(\w+)\s*((?:\[[^\]]*\])*)\s*$", re.S)
ALIGN = re.compile(r"\b(?:__align__|alignas)\s*\([^)]*\)")


def _declarations(m: re.Match) -> tuple[str, str | None, list[tuple[str, str]]]:
    """One `__shared__ T a[N], b[M];` match -> (T, its __align__ value or None, [(name, dims)])."""
    parts = m.group(1).split(",")
    first = FIRST.match(parts[0])
    if first is None:
        raise ValueError(f"cannot read the __shared__ declaration {m.group(0)!r}")
    align = ALIGN.search(first.group(1))
    ctype = ALIGN.sub("", first.group(1)).strip()
    decls = [(first.group(2), first.group(3))]
    for p in parts[1:]:
        d = DECLARATOR.match(p)
        if d is None:
            raise ValueError(f"cannot read the __shared__ declaration {m.group(0)!r}")
        decls.append((d.group(1), d.group(2)))
    value = re.search(r"\(([^)]*)\)", align.group(0)).group(1) if align else None
    return ctype, value, decls


def rewrite_shared(src: str) -> str:
    """`__shared__ T a[N], b[M];` -> references into the block's own poisoned memory;
    `extern __shared__ T s[];` -> a pointer to the launch's dynamic shared memory."""
    code = strip_comments(src)
    # every extern __shared__ array of a kernel starts at the same address, aligned for the
    # most demanding of them (ALIGN or the element type's alignof), and no more
    aligns = []
    for m in DYNAMIC.finditer(code):
        value = ALIGN.search(m.group(1))
        aligns.append(re.search(r"\(([^)]*)\)", value.group(0)).group(1) if value
                      else f"alignof({ALIGN.sub('', m.group(1)).strip()})")
    align = f"std::max<unsigned long long>({{{', '.join(aligns)}}})" if aligns else "1"
    code = DYNAMIC.sub(lambda m: f"{ALIGN.sub('', m.group(1)).strip()}* {m.group(2)} = "
                                 f"reinterpret_cast<{ALIGN.sub('', m.group(1)).strip()}*>"
                                 f"(qs::dynamic_shared({align}));", code)
    ids = itertools.count()

    def one(m):
        ctype, _, decls = _declarations(m)
        out = []
        for name, dims in decls:
            i = next(ids)
            if dims:
                out.append(f"{ctype} (&{name}){dims} = *reinterpret_cast<{ctype} (*){dims}>("
                           f"qs::shared({i}, sizeof({ctype}{dims}), \"{name}\", __LINE__));")
            else:
                out.append(f"{ctype}& {name} = *reinterpret_cast<{ctype}*>("
                           f"qs::shared({i}, sizeof({ctype}), \"{name}\", __LINE__));")
        return " ".join(out)

    return STATIC.sub(one, code)


KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?'
                    r'void\s+(\w+)\s*\((.*?)\)\s*\{', re.S)


def kernel_signatures(src: str) -> list[tuple[str, list[str]]]:
    """[(kernel name, [parameter declarations])] of every extern "C" __global__ kernel."""
    return [(m.group(1), [" ".join(p.split()) for p in m.group(2).split(",")])
            for m in KERNEL.finditer(strip_comments(src))]


def _body(code: str, start: int) -> str:
    """The text of the block that opens at code[start] ('{'), braces matched."""
    depth = 0
    for i in range(start, len(code)):
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        if depth == 0:
            return code[start:i + 1]
    raise ValueError("a kernel body without its closing brace")


def static_smem_functions(src: str) -> list[str]:
    """C++ functions `static_smem_<kernel>()`, one per kernel: the bytes of the static
    `__shared__` variables its body declares, each at an offset aligned as declared, the sum
    that ptxas reports as the kernel's static shared memory (tests/test_cuda_compile.py
    checks the two agree). A block reserves all of it at launch, whether or not the code a
    launch takes touches every variable. Compiled after the source, so its macros apply."""
    code = strip_comments(src)
    out = []
    for m in KERNEL.finditer(code):
        body = DYNAMIC.sub(" ", _body(code, m.end() - 1))
        lines = ["unsigned long long at = 0;"]
        for decl in STATIC.finditer(body):
            ctype, align, decls = _declarations(decl)
            for _, dims in decls:
                a = align or f"alignof({ctype})"
                lines.append(f"at = (at + ({a}) - 1) / ({a}) * ({a}) + sizeof({ctype}{dims});")
        out.append(f'extern "C" unsigned long long static_smem_{m.group(1)}() '
                   f'{{ {" ".join(lines)} return at; }}')
    return out


def unsupported(src: str) -> str | None:
    """A file can say `// Emulator: unsupported (why)` (tensor-core WMMA, bf16 ...)."""
    m = re.search(r"//\s*Emulator:\s*unsupported\s*(.*)", src)
    return m.group(1).strip() if m else None


# ---------------------------------------------------------------------------
# build and launch
# ---------------------------------------------------------------------------

C_TYPES = {"int": ctypes.c_int, "unsigned": ctypes.c_uint, "unsigned int": ctypes.c_uint,
           "float": ctypes.c_float, "long long": ctypes.c_longlong, "size_t": ctypes.c_size_t}
NP_SCALARS = {"int": np.int32, "unsigned": np.uint32, "unsigned int": np.uint32,
              "float": np.float32, "long long": np.int64, "size_t": np.uint64}
NP_POINTEES = {"int": np.int32, "float": np.float32, "unsigned": np.uint32,
               "unsigned int": np.uint32, "long long": np.int64}


def _base_type(param: str) -> tuple[str, bool]:
    """'const float* __restrict__ q' -> ('float', True)"""
    words = param.replace("*", " * ").split()
    pointer = "*" in words
    base = " ".join(w for w in words[:-1] if w not in ("const", "__restrict__", "*"))
    return base, pointer


class EmulatedKernel:
    """What cupy.RawModule(...).get_function(name) returns: kernel(grid, block, args,
    shared_mem=0), with the attribute max_dynamic_shared_size_bytes.

    Shared memory as CUDA counts it: the static part (static_smem, the kernel's `__shared__`
    variables) and the launch's dynamic part together get 48 KB by default, so the attribute
    starts at 48 KB minus the static part (what cuFuncGetAttribute reports); raising it is
    allowed while the static part plus it stays within the target's opt-in limit."""

    def __init__(self, fn, name: str, params: list[str], source: Path, target: str = TARGET,
                 static_smem: int = 0):
        self.name, self.params, self.source, self.target = name, params, source, target
        self.fn = fn
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.POINTER(LaunchArgs), ctypes.c_char_p, ctypes.c_int] + [
            ctypes.c_void_p if ptr else C_TYPES[base] for base, ptr in map(_base_type, params)]
        self.static_smem = int(static_smem)
        self._max_dynamic = max(0, DEFAULT_DYNAMIC_SMEM - self.static_smem)

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dynamic

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        limit = OPTIN_SMEM_LIMIT[self.target]
        if not 0 <= value <= limit - self.static_smem:
            raise EmulatorError(f"{self.name}: max_dynamic_shared_size_bytes = {value} is over the "
                                f"opt-in limit of {self.target} ({limit} bytes per block, "
                                f"{self.static_smem} of them static)")
        self._max_dynamic = int(value)

    def _check_launch(self, grid, block, shared_mem) -> tuple[tuple[int, ...], tuple[int, ...]]:
        name = self.name
        if not (1 <= len(grid) <= 3 and 1 <= len(block) <= 3):
            raise EmulatorError(f"{name}: grid {grid} and block {block} "
                                "must have 1 to 3 dimensions")
        g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
        b = tuple(int(x) for x in block) + (1,) * (3 - len(block))
        if min(g) < 1 or min(b) < 1:
            raise EmulatorError(f"{name}: grid {grid}, block {block}: every dimension must be at "
                                "least 1 (an empty launch is an invalid configuration on the GPU)")
        if b[0] * b[1] * b[2] > MAX_THREADS or any(x > m for x, m in zip(b, MAX_BLOCK)):
            raise EmulatorError(f"{name}: block {block} has {b[0] * b[1] * b[2]} threads; at most "
                                f"{MAX_THREADS} per block, and at most {MAX_BLOCK} per dimension")
        if any(x > m for x, m in zip(g, MAX_GRID)):
            raise EmulatorError(f"{name}: grid {grid} is over the limits {MAX_GRID}")
        if self.static_smem > STATIC_SMEM_LIMIT:
            raise EmulatorError(f"{name}: static __shared__ memory reaches {self.static_smem} "
                                f"bytes in all, over the {STATIC_SMEM_LIMIT} bytes a block may "
                                f"have (ptxas refuses it); use extern __shared__ and raise "
                                f"max_dynamic_shared_size_bytes")
        if shared_mem > self._max_dynamic:
            default = self._max_dynamic + self.static_smem == DEFAULT_DYNAMIC_SMEM
            why = (f", the {DEFAULT_DYNAMIC_SMEM} bytes a block gets by default less its "
                   f"{self.static_smem} static bytes" if default else "")
            most = OPTIN_SMEM_LIMIT[self.target] - self.static_smem
            raise EmulatorError(f"{name}: {shared_mem} bytes of dynamic shared memory, over the "
                                f"kernel's max_dynamic_shared_size_bytes ({self._max_dynamic})"
                                f"{why}; raise the attribute (at most {most} on {self.target})")
        return g, b

    def __call__(self, grid, block, args, shared_mem: int = 0, **_):
        name = self.name
        if len(args) != len(self.params):
            raise EmulatorError(f"{name}: {len(args)} arguments for {len(self.params)} parameters")
        g, b = self._check_launch(grid, block, int(shared_mem))
        values, ranges, names = [], [], []
        for arg, param in zip(args, self.params):
            base, pointer = _base_type(param)
            if pointer:
                if not isinstance(arg, Dev):
                    raise EmulatorError(f"{name}: {param} got {type(arg).__name__}, "
                                        "not a device array")
                if not arg.flags.c_contiguous:
                    raise EmulatorError(f"{name}: {param} is not contiguous")
                if arg.dtype != NP_POINTEES[base]:
                    raise EmulatorError(f"{name}: {param} got {arg.dtype}")
                values.append(arg.ctypes.data)
                ranges += [arg.ctypes.data, arg.ctypes.data + arg.nbytes]
                names.append((param.split()[-1].lstrip("*"), arg.itemsize))
            else:
                if type(arg) is not NP_SCALARS[base]:
                    raise EmulatorError(f"{name}: {param} got {type(arg).__name__}, "
                                        f"not {NP_SCALARS[base].__name__}")
                values.append(arg.item())
        number = next(_launch_number)
        seed = (SEED * 1_000_003 + number) % 2**63
        live = 2 + seed % 3
        bounds = (ctypes.c_ulonglong * max(1, len(ranges)))(*ranges)
        la = LaunchArgs(*g, *b, dynamic_smem=int(shared_mem), seed=seed, live=live,
                        watchdog_s=WATCHDOG_S, optin_smem=OPTIN_SMEM_LIMIT[self.target],
                        static_smem_limit=STATIC_SMEM_LIMIT, race=int(RACE),
                        nranges=len(ranges) // 2, ranges=bounds)
        err = ctypes.create_string_buffer(2048)
        if self.fn(ctypes.byref(la), err, len(err), *values) != 0:
            # {arg 2 byte 10} -> out[5] (the parameter's name)
            def element(m):
                pname, size = names[int(m.group(1))]
                return f"{pname}[{int(m.group(2)) // size}]"
            message = re.sub(r"\{arg (\d+) byte (\d+)\}", element,
                             err.value.decode(errors="replace"))
            raise EmulatorError(f"{name} ({self.source.name}): {message}\n"
                                f"[emulator: launch #{number}, seed {seed}, {live} blocks live; "
                                f"replay with QS_EMU_SEED={SEED}]")


# compiled with -fsanitize=thread (while RACE is on) and linked without it: the hooks in
# EMULATOR_H are the runtime that the instrumentation calls
CXXFLAGS = (("-std=c++20", "-O1", "-fPIC", "-pthread", "-w")
            + (("-fsanitize=thread",) if RACE else ()))
_header: Path | None = None


def _precompiled_header(gxx: str, build_dir: Path) -> Path:
    """emulator.h and its precompiled emulator.h.gch, made once per process (the standard
    headers it pulls in are most of each file's compile time)."""
    global _header
    if _header is None or not _header.with_suffix(".h.gch").is_file():
        header = build_dir / "emulator.h"
        header.write_text(EMULATOR_H)
        r = subprocess.run([gxx, *CXXFLAGS, "-x", "c++-header", str(header),
                            "-o", str(header) + ".gch"],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise EmulatorError(f"the emulator's header does not compile:\n{r.stderr[-4000:]}")
        _header = header
    return _header


# built libraries, by the hash of what went into them (compiler, flags, header, the rewritten
# source, its launchers): the emulated test files, the dry run of gpu_check.sh and the planted
# copies of one CI run compile each .cu once. QS_EMU_CACHE=DIR puts it elsewhere, =off disables it.
CACHE = os.environ.get("QS_EMU_CACHE") or str(
    Path(tempfile.gettempdir()) / f"qs-emu-cache-{os.getuid()}")


def _cached(gxx: str, code: str, launchers: list[str]) -> Path | None:
    if CACHE == "off":
        return None
    key = hashlib.sha256("\0".join([os.path.realpath(gxx), " ".join(CXXFLAGS), EMULATOR_H, code,
                                    *launchers]).encode()).hexdigest()[:32]
    folder = Path(CACHE)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{key}.so"


def build(sources: list[Path], build_dir: Path, timeout: int = 600) -> dict[str, EmulatedKernel]:
    """Compile each .cu file under the emulator (one g++ per file, all at once):
    kernel name -> EmulatedKernel. Raises EmulatorError with g++'s message."""
    gxx = shutil.which("g++")
    if gxx is None:
        raise FileNotFoundError("g++ is not installed")
    build_dir.mkdir(parents=True, exist_ok=True)
    header = None
    procs, sigs, libs = {}, {}, {}
    for i, cu in enumerate(sources):
        src = cu.read_text()
        sigs[cu] = kernel_signatures(src)
        launchers = []
        for name, params in sigs[cu]:
            names = ", ".join(p.split()[-1].lstrip("*") for p in params)
            launchers.append(
                f'extern "C" int launch_{name}(const qs::LaunchArgs* a, char* err, int errlen, '
                f'{", ".join(params)}) {{ return qs::launch(a, err, errlen, [=] {{ '
                f'{name}({names}); }}); }}')
        launchers += static_smem_functions(src)
        code = rewrite_shared(src)
        cached = _cached(gxx, code, launchers)
        if cached is not None and cached.is_file():     # built before, by this or another process
            libs[cu] = cached
            continue
        header = header or _precompiled_header(gxx, build_dir)
        stem = f"{i:02d}_{cu.parent.parent.name}_{cu.stem}"
        body = build_dir / f"{stem}.body.cu"
        body.write_text(f'#line 1 "{cu}"\n' + code)
        cpp = build_dir / f"{stem}.cpp"
        cpp.write_text(f'#include "{header}"\n#include "{body.name}"\n' + "\n".join(launchers)
                       + "\n")
        obj, so = build_dir / f"{stem}.o", build_dir / f"{stem}.so"
        cmd = (f"{shlex.quote(gxx)} {' '.join(CXXFLAGS)} -c {shlex.quote(str(cpp))} -o "
               f"{shlex.quote(str(obj))} && {shlex.quote(gxx)} -shared -pthread "
               f"{shlex.quote(str(obj))} -o {shlex.quote(str(so))}")
        procs[cu] = (subprocess.Popen(["sh", "-c", cmd], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True),
                     so, cached)
    for cu, (proc, so, cached) in procs.items():
        _, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise EmulatorError(f"{cu} does not compile as C++ under the emulator:\n{err[-4000:]}")
        libs[cu] = so
        # into the cache, atomically (other processes read it)
        if cached is not None:
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(so, tmp)
            os.replace(tmp, cached)
    out = {}
    for cu in sources:
        lib = ctypes.CDLL(str(libs[cu]))
        for name, params in sigs[cu]:
            static = getattr(lib, f"static_smem_{name}")
            static.restype = ctypes.c_ulonglong
            out[name] = EmulatedKernel(getattr(lib, f"launch_{name}"), name, params, cu,
                                       static_smem=static())
    return out


# ---------------------------------------------------------------------------
# a stand-in for CuPy: numpy arrays of a marker type, a capture that refuses what CuPy's
# refuses, and a count of the host's calls
# ---------------------------------------------------------------------------
#
# What the stand-in refuses during a stream capture, as CUDA 13 / CuPy 14 do on an H200:
#   * CuPy's cuBLAS wrapper (cupy.cuda.cublas.*): NotImplementedError("calling cuBLAS API during
#     stream capture is currently unsupported"), the message seen on the GPU;
#   * a synchronizing call: .get(), int()/float()/bool() of a device array, Device / Stream /
#     Event synchronize, cupy.asarray of host data (a copy from pageable memory);
#   * an allocation (cupy.empty, zeros, ..., and every elementwise op or fancy index, which
#     allocate their outputs): the stand-in is stricter than CuPy here (CuPy allocates from
#     its pool and the graph keeps the address, which the pool may hand out again), and
#     the engines allocate nothing in a captured step.
# A capture records the step's kernel launches and cuBLAS calls (through ctypes, cublas.py);
# a replay runs them again with the arguments they were recorded with, as a CUDA graph does,
# and like a CUDA graph it keeps none of those arrays alive: a replay that would touch memory
# freed since the capture fails. As in CuPy, a capture on the legacy default stream is refused,
# and only the capturing stream's calls are recorded (another stream's run at once).
#
# The counts (`HostCalls`) are what each call costs the host on a GPU: bench/lessons.py prices
# them with the per-call costs measured there (bench/host_costs.json).

class CaptureError(RuntimeError):
    """What CUDA says of a call that a stream capture cannot hold
    (cudaErrorStreamCaptureUnsupported)."""


CUBLAS_IN_CAPTURE = "calling cuBLAS API during stream capture is currently unsupported"


class HostCalls:
    """How many calls of each kind the host made (the price list's keys), and the bytes its
    copies brought back from the device (not priced: a count of what crossed)."""
    KINDS = ("launches", "blas", "allocations", "elementwise", "copies", "syncs", "graph_launches")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        for k in self.KINDS:
            setattr(self, k, 0)
        self.bytes_to_host = 0

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.KINDS}


class _State:
    """The stand-in device's state: the current stream, the capture in progress, the counts."""

    def __init__(self):
        self.calls = HostCalls()
        self.capture = None                  # the list a capture records into, or None
        self.capturing = None                # the stream that captures
        self.stream = None                   # the current stream (None: the null stream)
        self.owners = {}                     # address -> _Pointer (a graph's cuBLAS calls)
        self.execute = True                  # False: kernels and GEMMs are counted, not run

    def refuse(self, what: str) -> None:
        if self.capture is not None:
            raise CaptureError(f"{what} is not permitted while a stream is capturing "
                               f"(cudaErrorStreamCaptureUnsupported)")


STATE = _State()


def _fancy(key) -> bool:
    """An index that gathers (arrays, lists, booleans) rather than slicing a view."""
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (np.ndarray, list)) for k in keys)


class Dev(np.ndarray):
    """A 'device array' of the stand-in CuPy: a numpy array that kernels.py must treat as cupy.
    Views (slices, reshape, view) cost nothing; what would run a kernel, copy or wait on a GPU
    is counted, and refused during a capture."""

    def get(self) -> np.ndarray:
        STATE.refuse("a device-to-host copy (.get)")
        STATE.calls.copies += 1
        STATE.calls.syncs += 1
        STATE.calls.bytes_to_host += self.nbytes
        return np.array(self, copy=True).view(np.ndarray)

    def set(self, host, stream=None) -> None:
        STATE.refuse("a host-to-device copy (.set)")
        STATE.calls.copies += 1
        np.ndarray.__setitem__(self, Ellipsis, host)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        STATE.refuse(f"an elementwise kernel ({ufunc.__name__}, and its output's allocation)")
        if ufunc is np.matmul:
            STATE.calls.blas += 1
        else:
            STATE.calls.elementwise += 1
        if "out" not in kwargs:
            STATE.calls.allocations += 1
        args = [np.asarray(x).view(np.ndarray) if isinstance(x, Dev) else x for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, Dev) else o
                                  for o in kwargs["out"])
        result = getattr(ufunc, method)(*args, **kwargs)
        if "out" in kwargs:
            return inputs[0] if method == "at" else kwargs["out"][0].view(Dev)
        # a reduction too: a 0-d device array, as in CuPy
        return np.asarray(result).view(Dev)

    def __getitem__(self, key):
        if _fancy(key):
            STATE.refuse("a gather (fancy indexing allocates its output)")
            STATE.calls.elementwise += 1
            STATE.calls.allocations += 1
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        STATE.refuse("an assignment into a device array (a copy kernel)")
        STATE.calls.elementwise += 1
        if isinstance(value, np.ndarray) and not isinstance(value, Dev):
            STATE.calls.copies += 1                   # host data: a copy first
        super().__setitem__(key, value)

    def _sync(self, what: str):
        STATE.refuse(what)
        STATE.calls.copies += 1
        STATE.calls.syncs += 1

    def __int__(self):
        self._sync("int() of a device array")
        return int(self.view(np.ndarray))

    def __float__(self):
        self._sync("float() of a device array")
        return float(self.view(np.ndarray))

    def __bool__(self):
        self._sync("bool() of a device array")
        return bool(self.view(np.ndarray))

    def __index__(self):
        self._sync("a device array used as an index")
        return int(self.view(np.ndarray))

    def item(self, *args):
        self._sync(".item()")
        return self.view(np.ndarray).item(*args)

    def tolist(self):
        self._sync(".tolist()")
        return self.view(np.ndarray).tolist()

    def copy(self, order="C"):
        STATE.refuse("a device copy (it allocates)")
        STATE.calls.allocations += 1
        STATE.calls.elementwise += 1
        return np.array(self.view(np.ndarray), copy=True, order=order).view(Dev)

    def astype(self, dtype, *args, **kwargs):
        if np.dtype(dtype) == self.dtype and kwargs.get("copy", True) is False:
            return self
        STATE.refuse("astype (it allocates)")
        STATE.calls.allocations += 1
        STATE.calls.elementwise += 1
        return self.view(np.ndarray).astype(dtype, *args, **kwargs).view(Dev)


def dev(a) -> Dev:
    """A device copy of host data, made by the test (not counted)."""
    return np.ascontiguousarray(a).copy().view(Dev)


def _alloc(array: np.ndarray, what: str) -> Dev:
    STATE.refuse(f"{what} (an allocation)")
    STATE.calls.allocations += 1
    return array.view(Dev)


class _Pool:
    """cupy.get_default_memory_pool(): nothing cached on the host."""

    def free_all_blocks(self):
        pass

    def free_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0


class Stream:
    """cupy.cuda.Stream: `with stream:` makes it current; begin_capture / end_capture record."""
    _ptrs = itertools.count(2)                         # (0 and 1: the legacy default stream)

    def __init__(self, non_blocking: bool = False, null: bool = False):
        self.ptr = 0 if null else next(Stream._ptrs)
        self.non_blocking = non_blocking
        self._outer = []

    def __enter__(self):
        self._outer.append(STATE.stream)
        STATE.stream = self
        return self

    def __exit__(self, *exc):
        STATE.stream = self._outer.pop()
        return False

    def synchronize(self) -> None:
        STATE.refuse("Stream.synchronize")
        STATE.calls.syncs += 1

    def begin_capture(self, mode=None) -> None:
        if self.ptr in (0, 1):                          # CuPy's own check, before CUDA's
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if STATE.capture is not None:
            raise CaptureError("a capture is already in progress")
        STATE.capture, STATE.capturing = [], self

    def end_capture(self) -> "Graph":
        if STATE.capture is None or STATE.capturing is not self:
            raise CaptureError("end_capture without begin_capture on this stream")
        recorded, STATE.capture, STATE.capturing = STATE.capture, None, None
        return Graph(recorded)


NULL_STREAM = Stream(null=True)


class Graph:
    """A captured graph: its recorded calls, run again (with the recorded arguments) per launch.
    Like a CUDA graph it keeps no array alive: a recorded argument whose memory was freed
    since the capture fails the replay (_Pointer)."""

    def __init__(self, calls: list):
        self.calls = calls

    def launch(self, stream=None) -> None:
        STATE.refuse("a graph launch inside a capture")
        STATE.calls.graph_launches += 1
        if STATE.execute:
            for call in self.calls:
                call()


class Event:
    def __init__(self, disable_timing: bool = False, **_):
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        STATE.refuse("Event.synchronize")
        STATE.calls.syncs += 1


def _recorded(run, count: str, replay=None):
    """Run a device call now, or record it into the capture in progress; count it either way.
    replay: what the graph keeps instead of `run` (one that holds no array alive).
    A call on another stream than the capturing one runs now, as CUDA runs it, unless it is the
    legacy default stream and the capturing stream synchronizes with it (not non_blocking):
    CUDA's cudaErrorStreamCaptureImplicit."""
    setattr(STATE.calls, count, getattr(STATE.calls, count) + 1)
    current = STATE.stream or NULL_STREAM
    if STATE.capture is not None and current is STATE.capturing:
        STATE.capture.append(replay or run)
        return
    if STATE.capture is not None and current.ptr in (0, 1) and not STATE.capturing.non_blocking:
        raise CaptureError("a call on the legacy default stream while a blocking stream captures "
                           "(cudaErrorStreamCaptureImplicit)")
    if STATE.execute:
        run()


class _Pointer:
    """A device array as a graph records it: its address and layout and a weak reference to
    the array that owns the memory. A replay rebuilds the array, or fails when the memory was
    freed since the capture (on the GPU the graph would read or write memory that CuPy's pool
    may have handed to another array)."""

    def __init__(self, a: np.ndarray, what: str):
        owner = a
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        # (memory from outside numpy, which a weak reference cannot follow, is kept alive)
        self.owner = weakref.ref(owner) if owner.base is None else (lambda: owner)
        self.offset = a.ctypes.data - owner.ctypes.data
        self.shape, self.dtype, self.strides, self.what = a.shape, a.dtype, a.strides, what

    def get(self) -> "Dev":
        owner = self.owner()
        if owner is None:
            raise CaptureError(f"a graph replay uses {self.what}, whose memory was freed after the "
                               f"capture (a graph keeps no array alive: keep what it reads and "
                               f"writes as long as the graph)")
        return np.ndarray(self.shape, self.dtype, buffer=owner.view(np.ndarray), offset=self.offset,
                          strides=self.strides).view(Dev)


class Launcher:
    """What cupy.RawModule(...).get_function(name) returns, on the stand-in: a kernel call is
    counted, recorded during a capture (with its arguments as they are now: a graph keeps
    pointers and scalars), and run by the emulator otherwise (or not at all when counting)."""

    def __init__(self, kernel=None, name: str = "kernel"):
        self.kernel, self.name = kernel, name
        self._counted_max = DEFAULT_DYNAMIC_SMEM      # the attribute, when counted, not run

    @property
    def max_dynamic_shared_size_bytes(self):
        if self.kernel is None:
            return self._counted_max
        return self.kernel.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        if self.kernel is not None:
            self.kernel.max_dynamic_shared_size_bytes = value
        self._counted_max = value

    def __call__(self, grid, block, args, shared_mem: int = 0, **kw):
        kernel, args = self.kernel, tuple(args)
        if kernel is None:                              # counted, not run
            _recorded(lambda: None, "launches")
            return
        pointers = tuple(_Pointer(a, f"argument {i} of {self.name}") if isinstance(a, Dev) else a
                         for i, a in enumerate(args))

        def replay():
            kernel(grid, block, tuple(a.get() if isinstance(a, _Pointer) else a for a in pointers),
                   shared_mem=shared_mem)
        _recorded(lambda: kernel(grid, block, args, shared_mem=shared_mem), "launches", replay)


def _matrix(ptr: int, dtype: int, ld: int, rows: int, cols: int) -> np.ndarray:
    """A column-major rows x cols matrix at ptr with leading dimension ld, as a writable numpy
    view (dtype: cuBLAS's CUDA_R_32F = 0 or CUDA_R_16BF = 14, the latter as uint16 bits)."""
    ctype, nptype = {0: (ctypes.c_float, np.float32), 14: (ctypes.c_uint16, np.uint16)}[dtype]
    buf = np.ctypeslib.as_array((ctype * (ld * cols)).from_address(ptr)).view(nptype)
    return buf.reshape(cols, ld)[:, :rows].T


def _widen(m: np.ndarray) -> np.ndarray:
    return ((m.astype(np.uint32) << 16).view(np.float32) if m.dtype == np.uint16
            else m.astype(np.float32))


def _narrow(y: np.ndarray, dtype) -> np.ndarray:
    if dtype != np.uint16:
        return y.astype(np.float32)
    u = np.ascontiguousarray(y, dtype=np.float32).view(np.uint32)     # round to nearest even,
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16                    # a NaN a quiet NaN
    quiet_nan = ((u >> 16) & 0x8000) | 0x7FC0
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, quiet_nan, rounded).astype(np.uint16)


def gemm_ex(transa, transb, m, n, k, alpha: float, a_ptr, a_type, lda, b_ptr, b_type, ldb,
            beta: float, c_ptr, c_type, ldc) -> None:
    """cublasGemmEx as cuBLAS reads it: C [m, n] = alpha op(A) [m, k] op(B) [k, n] + beta C,
    column-major, fp32 products and sums."""
    a = _matrix(a_ptr, a_type, lda, *((k, m) if transa == 1 else (m, k)))
    b = _matrix(b_ptr, b_type, ldb, *((n, k) if transb == 1 else (k, n)))
    a, b = (a.T if transa == 1 else a), (b.T if transb == 1 else b)
    c = _matrix(c_ptr, c_type, ldc, m, n)
    y = np.float32(alpha) * (_widen(np.ascontiguousarray(a)) @ _widen(np.ascontiguousarray(b)))
    if beta:
        y = y + np.float32(beta) * _widen(c)
    c[...] = _narrow(y, c.dtype)


class FakeBlas:
    """stage3_optimized.cublas.Blas on the stand-in: the ctypes cublasGemmEx path, which a
    capture may record (as on the GPU). The real Blas (its library lookup, the order of its
    calls, its argument types) runs against a stand-in libcublas in tests/test_stage3_cublas.py."""

    def gemm(self, transa, transb, m, n, k, a, a_type, lda, b, b_type, ldb, c, c_type, ldc,
             accumulate) -> None:
        def run():
            gemm_ex(transa, transb, m, n, k, 1.0, a, a_type, lda, b, b_type, ldb,
                    1.0 if accumulate else 0.0, c, c_type, ldc)
        owners = [STATE.owners.get(ptr) for ptr in (a, b, c)]   # (noted by _ptr)

        def replay():
            for ref in filter(None, owners):
                ref.get()                                             # fails when freed
            run()
        _recorded(run, "blas", replay)


def _wrapper_blas(name: str):
    """CuPy's own cuBLAS wrapper (cupy.cuda.cublas): refuses to run during a capture."""
    def call(*args):
        if STATE.capture is not None:
            raise NotImplementedError(CUBLAS_IN_CAPTURE)
        if name == "gemmEx":
            (handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
             ldc, compute, algo) = args
            STATE.calls.blas += 1
            if STATE.execute:
                gemm_ex(transa, transb, m, n, k, ctypes.c_float.from_address(alpha).value, A, Atype,
                        lda, B, Btype, ldb, ctypes.c_float.from_address(beta).value, C, Ctype, ldc)
    return call


def _elementwise(what: str) -> None:
    """An elementwise kernel and its output's allocation, counted (refused in a capture)."""
    STATE.refuse(f"cupy.{what} (an elementwise kernel, and its output's allocation)")
    STATE.calls.elementwise += 1
    STATE.calls.allocations += 1


def _where(condition, a, b):
    _elementwise("where")
    return np.where(*(np.asarray(v).view(np.ndarray) if isinstance(v, Dev) else v
                      for v in (condition, a, b))).view(Dev)


def _isfinite(a):
    _elementwise("isfinite")
    return np.isfinite(np.asarray(a).view(np.ndarray)).view(Dev)


def fake_cupy() -> types.ModuleType:
    """The stand-in `cupy` module (and `cupy.cuda`): see the section's comment."""
    cp = types.ModuleType("cupy")

    def as_dev(a, dtype=None, what="cupy.asarray of host data"):
        if isinstance(a, Dev) and (dtype is None or np.dtype(dtype) == a.dtype):
            return a                                               # already there: CuPy returns it
        if isinstance(a, Dev):
            return a.astype(dtype)
        STATE.refuse(what)
        STATE.calls.copies += 1
        STATE.calls.allocations += 1
        return np.array(a, dtype=dtype, copy=True).view(Dev)

    def contiguous(a, dtype=None):
        if (isinstance(a, Dev) and a.flags.c_contiguous
                and (dtype is None or np.dtype(dtype) == a.dtype)):
            return a
        if isinstance(a, Dev):
            STATE.refuse("a contiguous copy (it allocates)")
            STATE.calls.allocations += 1
            STATE.calls.elementwise += 1
            return np.ascontiguousarray(a.view(np.ndarray), dtype=dtype).view(Dev)
        return as_dev(np.ascontiguousarray(a, dtype=dtype))

    cp.asarray = as_dev
    cp.array = lambda a, dtype=None, copy=True: (a.copy() if isinstance(a, Dev)
                                                 else as_dev(a, dtype))
    cp.ascontiguousarray = contiguous
    # CuPy zero-fills with a memset; the stand-in counts the allocation (and zero-fills even
    # `empty`, so that a kernel that is counted, not run, leaves defined values behind)
    cp.empty = lambda shape, dtype=np.float32: _alloc(np.zeros(shape, dtype), "cupy.empty")
    cp.zeros = lambda shape, dtype=np.float32: _alloc(np.zeros(shape, dtype), "cupy.zeros")
    cp.full = lambda shape, value, dtype=None: _alloc(np.full(shape, value, dtype), "cupy.full")
    cp.empty_like = lambda a, dtype=None: _alloc(np.zeros_like(np.asarray(a), dtype=dtype),
                                                 "cupy.empty_like")
    cp.zeros_like = lambda a, dtype=None: _alloc(np.zeros_like(np.asarray(a), dtype=dtype),
                                                 "cupy.zeros_like")
    cp.arange = lambda *a, dtype=None: _alloc(np.arange(*a, dtype=dtype), "cupy.arange")
    cp.argmax = lambda a, axis=None: _alloc(np.asarray(np.argmax(np.asarray(a), axis=axis)),
                                            "cupy.argmax")
    cp.asnumpy = lambda a: a.get() if isinstance(a, Dev) else np.asarray(a)
    cp.exp, cp.matmul = np.exp, np.matmul

    cp.where, cp.isfinite = _where, _isfinite
    cp.float32, cp.int32, cp.int64, cp.uint16, cp.uint32, cp.uint8 = (
        np.float32, np.int32, np.int64, np.uint16, np.uint32, np.uint8)
    cp.get_default_memory_pool = lambda: _Pool()

    cuda = types.ModuleType("cupy.cuda")
    cublas = types.ModuleType("cupy.cuda.cublas")
    for name in ("gemmEx", "setStream", "setPointerMode", "sgemm", "sgemmEx"):
        setattr(cublas, name, _wrapper_blas(name))
    cuda.cublas = cublas
    cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: 0)
    cuda.runtime = types.SimpleNamespace(getDeviceCount=lambda: 1)

    class Device:
        def __init__(self, index: int = 0):
            self.mem_info = (64 * 2**30, 80 * 2**30)

        def synchronize(self):
            STATE.refuse("Device.synchronize")
            STATE.calls.syncs += 1

    cuda.Device = Device
    cuda.Stream, cuda.Event = Stream, Event
    cuda.get_current_stream = lambda: STATE.stream or NULL_STREAM
    cuda.alloc_pinned_memory = lambda nbytes: bytearray(nbytes)
    cp.cuda = cuda
    return cp


class FakeCuda:
    """The stand-in installed for one test (or one counted run): `install` puts it in place."""

    def __init__(self, cp: types.ModuleType):
        self.cupy = cp
        self.calls = STATE.calls

    @staticmethod
    def dev(a) -> Dev:
        return dev(a)


def install(monkeypatch, kernels_module, emulated: dict | None, execute: bool = True) -> FakeCuda:
    """A stage's kernels.py on the stand-in CuPy: `cupy` in sys.modules, `_on_gpu` true for Dev
    arrays, every kernel through a Launcher (the emulated kernel, or none when `emulated` is
    None: counted, not run), device addresses from numpy, and the ctypes cuBLAS of stage 3
    (cublas.blas) as FakeBlas where the module has it. execute=False counts calls without
    running kernels or GEMMs (bench/lessons.py's count of a step's host calls)."""
    cp = fake_cupy()
    STATE.calls.reset()
    STATE.capture, STATE.capturing, STATE.stream = None, None, None
    STATE.owners.clear()
    monkeypatch.setattr(STATE, "execute", execute)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cp.cuda)
    monkeypatch.setitem(NP_POINTEES, "unsigned short", np.uint16)
    monkeypatch.setattr(kernels_module, "_on_gpu", lambda x: isinstance(x, Dev))
    launchers = {}

    def kernel(name):
        if name not in launchers:
            launchers[name] = Launcher(emulated[name] if emulated is not None else None, name)
        return launchers[name]
    if hasattr(kernels_module, "_compile"):
        # the module's own _kernel (its attributes: the shared memory it raises) on the
        # emulated kernels, with a cache of its own for this install
        monkeypatch.setattr(kernels_module, "_compile", kernel)
        fresh = functools.cache(kernels_module._kernel.__wrapped__)
        monkeypatch.setattr(kernels_module, "_kernel", fresh)
    else:
        monkeypatch.setattr(kernels_module, "_kernel", kernel)
    if hasattr(kernels_module, "_ptr"):
        def ptr(x):
            STATE.owners[x.ctypes.data] = _Pointer(x, "a cuBLAS operand")   # (for a graph's replay)
            return x.ctypes.data
        monkeypatch.setattr(kernels_module, "_ptr", ptr)
    if hasattr(kernels_module, "to_host"):              # (it tells the devices apart by np.ndarray)
        monkeypatch.setattr(kernels_module, "to_host",
                            lambda x: x.get() if isinstance(x, Dev) else x)
    blas_module = getattr(kernels_module, "cublas", None)
    if blas_module is not None and hasattr(blas_module, "blas"):
        fake = FakeBlas()
        monkeypatch.setattr(blas_module, "blas", lambda: fake)
    return FakeCuda(cp)
