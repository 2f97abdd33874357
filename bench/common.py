"""Helpers every benchmark shares: medians, the machine's load, memory bandwidth,
one engine per subprocess (so peak RSS belongs to that engine alone), tables.

Nothing here imports torch: a worker that measures stage 1 or llama.cpp must not
pay torch's few hundred MB of RSS.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import bench

# a 1-minute load above this (before we start) means someone else is running
BUSY_LOAD = 0.5
RESULT_TAG = "BENCH-RESULT "   # the line a worker prints its JSON result on


def median(xs: list[float]) -> float:
    """Median of the runs; nan when there are none (a failed cell)."""
    return statistics.median(xs) if xs else float("nan")


def check_load(when: str) -> str:
    """A line for the report: the 1-minute load average (roughly how many threads wanted a core
    lately); it warns when the machine was busy (numbers are then low)."""
    load = os.getloadavg()[0]
    line = f"1-minute load {when}: {load:.2f} on {os.cpu_count()} cores"
    if load > BUSY_LOAD:
        line += "  WARNING: the machine was busy; speeds may be low (rerun when idle)"
    return line


class NeighbourMeter:
    """How much CPU *other* processes used while the benchmark ran.

    The load average counts our own threads too, so after a run it says little. Here:
    busy CPU seconds of the whole machine (/proc/stat) minus the seconds this process
    and its workers used (os.times), divided by the wall time: 0.0 means the machine
    was ours, 1.0 means a neighbour kept one core busy all along.
    """

    def __init__(self):
        self.t0, self.busy0, self.ours0 = time.perf_counter(), self._busy(), self._ours()

    @staticmethod
    def _busy() -> float:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return float("nan")
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)     # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")    # user..steal, in seconds

    @staticmethod
    def _ours() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def cores_used_by_others(self) -> float:
        wall = time.perf_counter() - self.t0
        others = (self._busy() - self.busy0) - (self._ours() - self.ours0)
        return max(0.0, others / wall) if wall > 0 else float("nan")


# a busy process: a pure-Python loop that ends once its parent (argv[1]) is gone
BUSY_LOOP = "import os, sys\nwhile os.getppid() == int(sys.argv[1]):\n    sum(range(10**6))"


@contextmanager
def busy_cores(n: int):
    """`with busy_cores(n) as busy:` n processes that each keep a core busy (BUSY_LOOP: the browser
    or the build on a student's laptop) while the block runs. They end with the block however it
    ends (an error, Ctrl-C); should this process die first, each sees its parent gone within a
    moment and ends. busy["pids"]; busy["cores"], once the block ends: the cores they kept busy on
    average (their CPU seconds, read as they are reaped, over the wall time)."""
    procs, busy, t0 = [], {"pids": [], "cores": 0.0}, time.perf_counter()
    cmd, quiet = [sys.executable, "-c", BUSY_LOOP, str(os.getpid())], subprocess.DEVNULL
    try:
        for _ in range(n):                               # (quiet: Ctrl-C reaches them too)
            procs.append(subprocess.Popen(cmd, stdin=quiet, stdout=quiet, stderr=quiet))
            busy["pids"].append(procs[-1].pid)
        yield busy
    finally:
        for p in procs:
            p.kill()
            _, status, usage = os.wait4(p.pid, 0)         # reaped here, for its CPU time
            p.returncode = os.waitstatus_to_exitcode(status)
            busy["cores"] += (usage.ru_utime + usage.ru_stime) / (time.perf_counter() - t0)


def cpu_flags() -> tuple[str, set[str]]:
    """(the CPU's model name, its /proc/cpuinfo flags); ("unknown CPU", set()) where there is
    none."""
    cpu, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("unknown CPU", platform.processor()):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return cpu, flags


def machine_description() -> str:
    """CPU model, cores, memory and the SIMD features that matter for these kernels."""
    cpu, flags = cpu_flags()
    simd = [f for f in ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni",
                        "avx512_bf16", "amx_bf16")
            if f in flags]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, "
            f"SIMD: {' '.join(simd) or 'none detected'}")


# ---------------------------------------------------------------- bandwidth

def measure_bandwidth(threads: list[int], mib: int = 1024, repeats: int = 5) -> dict:
    """Memory bandwidth in GB/s (1e9 bytes/s), the roofline's denominator: read[n], a numba
    prange sum over a `mib` MiB float32 array with n threads, best of `repeats` (the roofline
    is what the memory *can* do), by a BandwidthProbe. Decode streams every weight once per
    token and writes almost nothing, so a pure read is the right ceiling; the array is far
    larger than any cache, so every pass goes to DRAM."""
    probe = BandwidthProbe(mib, repeats)
    try:
        return {"mib": mib, "read": {n: probe.read(n) for n in threads}}
    finally:
        probe.close()


class BandwidthProbe:
    """The read bandwidth *right now*, from a process of its own.

    This VM's 2-thread read bandwidth jumps between ~35 and ~55 GB/s within seconds
    (docs/benchmarks.md), so a figure taken minutes before a decode run says little
    about that run. A worker asks this probe just before and just after each timed
    decode run. It lives in its own process so that its 256 MiB array never counts in
    the engine's peak RSS and its numba threads never share the engine's thread pool;
    between questions it sleeps on a pipe.
    """

    def __init__(self, mib: int = 256, repeats: int = 3):
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)
                   + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.common", "--probe", str(mib), str(repeats)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the bandwidth probe did not start")

    def read(self, threads: int) -> float:
        """GB/s that `threads` threads read right now (best of the probe's passes)."""
        self.proc.stdin.write(f"{threads}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


def _probe_server(mib: int, repeats: int) -> None:
    """The probe's process: one line in (a thread count), one line out (GB/s)."""
    import numba
    import numpy as np

    @numba.njit(parallel=True, fastmath=True, cache=False)
    def read_sum(a):
        """A prange sum: each thread reads one contiguous slice, vectorised; nothing but
        loads, so it runs at what the memory delivers."""
        s = 0.0
        for i in numba.prange(a.shape[0]):
            s += a[i]
        return s

    a = np.ones(mib * 2**20 // 4, dtype=np.float32)
    # compile before timing (np.ones touched every page)
    read_sum(a[:1024])
    print("ready", flush=True)
    for line in sys.stdin:
        numba.set_num_threads(min(int(line), numba.config.NUMBA_NUM_THREADS))
        best = 1e9
        for _ in range(repeats):
            t0 = time.perf_counter()
            read_sum(a)
            best = min(best, time.perf_counter() - t0)
        print(f"{a.nbytes / best / 1e9:.3f}", flush=True)


def stage1_bytes(weights, decode: bool = False) -> int:
    """Bytes of every matrix of a stage-1 Weights (the roofline's numerator): attention, MLPs,
    routers, shared experts and their gates, the lm_head (the embedding counted once, as the
    lm_head when tied; norms and biases left out), and every routed expert; with decode=True,
    what one decode token reads: each MoE layer's routed experts counted for the k of E a token
    goes to. (Stages 2 and 3 count their own, Weights.nbytes; stage 1's weights.py only loads.)"""
    cfg = weights.config
    share = cfg.num_experts_per_tok / cfg.num_experts if decode and cfg.num_experts else 1.0
    names = ("wqkv", "wo", "w_gate_up", "w_down", "router", "shared_gate_up", "shared_down",
             "shared_gate")
    mats = [weights.lm_head] + [getattr(l, n) for l in weights.layers for n in names]
    routed = sum(l.experts_gate_up.nbytes + l.experts_down.nbytes for l in weights.layers
                 if l.experts_gate_up is not None)
    return sum(w.nbytes for w in mats if w is not None) + round(routed * share)


# ---------------------------------------------------------------- workers

def peak_rss_mib() -> float:
    """This process's peak resident set in MiB.

    VmHWM (the high-water mark of this process's memory map) and not ru_maxrss:
    Linux carries ru_maxrss over from the parent through fork + exec, so a worker
    started by a parent holding 1 GB would report at least 1 GB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024          # kB -> MiB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def policy_env(omp_wait_policy: str, extra: dict | None = None) -> dict:
    """This process's environment for a benchmark's child under an OpenMP wait policy: PASSIVE,
    ACTIVE, or "default", unset, as users run the engines: stage 1 then chooses its own (stage1_cpu/
    __init__.py), llama.cpp leaves it to OpenMP (libgomp spins a while). OPENBLAS_THREAD_TIMEOUT
    comes from bench/__init__.py (a worker imports numpy before stage 1 could set it)."""
    env = dict(os.environ, **(extra or {}))
    if omp_wait_policy == "default":
        env.pop("OMP_WAIT_POLICY", None)
    else:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    return env


def as_users_run(engine: str) -> None:
    """In a worker of a peer (llama.cpp, transformers): OMP_WAIT_POLICY as this process was
    started with (policy_env's), not stage 1's choice, which importing stage1_cpu sets in the
    environment; the peer's OpenMP reads it when its library loads, after this."""
    if engine == "stage1":
        return
    if bench.STARTED_WITH_OMP_WAIT_POLICY is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = bench.STARTED_WITH_OMP_WAIT_POLICY


def run_worker(module: str, spec: dict, timeout: float, log=print, omp_wait_policy: str = "PASSIVE",
               env_extra: dict | None = None) -> dict:
    """Run `python -m module --worker SPEC` in a fresh process and return its JSON result.

    One process per engine: its peak RSS is that engine's alone, a crash or a missing
    package costs one table cell and not the run, and numba/torch/llama.cpp threads
    never share a process. The worker's own lines are echoed (indented) as progress.
    omp_wait_policy: PASSIVE, ACTIVE, or "default" (unset: the OpenMP runtime's own choice);
    env_extra: more variables for this worker alone (e.g. NUMBA_CPU_NAME, LLAMA_CPP_LIB_PATH).
    """
    env = policy_env(omp_wait_policy, env_extra)
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", module, "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=repo_root)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
        elif line.strip():
            log("    " + line)
    if result is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"worker exited with {proc.returncode}: " + " | ".join(tail)}
    return result


def emit_result(result: dict) -> None:
    """The worker side of run_worker: one tagged JSON line on stdout."""
    result["peak_rss_mib"] = peak_rss_mib()
    print(RESULT_TAG + json.dumps(result), flush=True)


# ---------------------------------------------------------------- options and results

def items(kind=str, allowed=()):
    """An argparse type: a comma-separated list ("1,2"; "" for none) of `kind`, each one of
    `allowed` (and at least one) where that is given."""
    def parse(text: str) -> list:
        got = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if allowed and (not got or set(got) - set(allowed)):
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return got
    return parse


def save_json(path: Path, command: str, **fields) -> None:
    """A benchmark's saved run, which `bench report` and `bench figures` read: the command that
    made it, the date (UTC), the machine, then the benchmark's own fields."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(command=command,
                                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                    machine=machine_description(), **fields), indent=1) + "\n")


def versions() -> dict:
    """The versions of the engines' packages (and numba's, torch's) a saved run ran on."""
    packages = {"llama-cpp-python": "llama_cpp", "numba": "numba", "torch": "torch",
                "transformers": "transformers"}
    return {pkg: importlib.metadata.version(pkg) for pkg, module in packages.items()
            if importlib.util.find_spec(module)}


def fmt_num(x: float | None, digits: int = 1) -> str:
    if x is None or x != x:          # None or nan: the cell was not measured
        return "–"
    return f"{x:,.{digits}f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub pipe table, padded so it also reads well in a terminal."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def rungs_table(rows: list[dict], ms: str, rate: str | None = None) -> str:
    """A ladder's rungs (bench ladder's rows), each against the one before and the first, in `ms`
    (ms_per_token, ms_per_prompt_token); rate "GB/s": of weights (rungs 1-2 also write and re-read
    an fp32 copy), "GMAC/s": multiply-adds, None: no such column (what the saved rows lack)."""
    speed = {"GB/s": lambda r: r["mb_per_token"] / r[ms],
             "GMAC/s": lambda r: r["macs"] / (r[ms] * 1e6)}
    body = [[r["rung"], r["what"], r["weights"], r["threads"], f"{r[ms]:.3g}"]
            + ([f"{speed[rate](r):.1f}"] if rate else [])
            + [f"{rows[i - 1][ms] / r[ms]:.2f}×" if i else "", f"{rows[0][ms] / r[ms]:.1f}×"]
            for i, r in enumerate(rows)]
    head = ["rung", "what", "weights", "threads", ms.replace("_", " ")] + ([rate] if rate else [])
    return markdown_table(head + ["× previous", "× first"], body)


def decode_speed(row: dict) -> float:
    """A request's decode tok/s (bench cpu --speculative's rows): the tokens after the first over
    the seconds after the first."""
    return (row["tokens"] - 1) / row["decode_seconds"]


if __name__ == "__main__" and sys.argv[1:2] == ["--probe"]:
    _probe_server(int(sys.argv[2]), int(sys.argv[3]))
