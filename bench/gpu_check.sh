#!/usr/bin/env bash
# bench/gpu_check.sh — everything stage 2 needs a GPU for, in one run (< 8 minutes on one H200):
#   1. the machine: nvidia-smi, CuPy (installed from a wheel if missing and reachable)
#   2. tests/test_stage2_gpu.py: every CUDA kernel against its numpy twin at awkward shapes,
#      and the engine's greedy tokens against transformers on the GPU
#   3. python -m bench.gpu: nano-vllm's throughput workload and batch-1 decode, stage 2
#      against transformers on the same GPU, plus the HBM roofline
# Results go to $OUT (default ./gpu_results): gpu_tests.txt, gpu_tests.xml, gpu_bench.md,
# gpu_bench.json, summary.md, and one log per step. Each step is time-boxed with `timeout`
# and a failing step does not stop the next one.
#
# usage: OUT=/some/dir bash bench/gpu_check.sh [--quick]
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_results}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"
QUICK="${1:-}"
START=$(date +%s)
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.md"
echo "# stage 2 GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')" > "$SUMMARY"
elapsed() { echo $(( $(date +%s) - START )); }
note() { echo "$*" | tee -a "$SUMMARY"; }

# ---- 1. the machine --------------------------------------------------------------
timeout 20 nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || note "nvidia-smi failed or is missing"
head -15 "$OUT/nvidia-smi.txt" 2>/dev/null
if ! timeout 60 "$PY" -c "import cupy; cupy.cuda.runtime.getDeviceCount()" > /dev/null 2>&1; then
    note "CuPy missing or broken: trying pip install cupy-cuda12x (needs a wheel index)"
    timeout 150 "$PY" -m pip install -q cupy-cuda12x > "$OUT/pip_cupy.log" 2>&1 \
        || note "pip install cupy-cuda12x failed (see pip_cupy.log)"
fi
CUPY=$(timeout 60 "$PY" -c "import cupy; print(cupy.__version__, cupy.cuda.runtime.runtimeGetVersion(), cupy.cuda.runtime.getDeviceCount(), 'GPU(s)')" 2>&1 | tail -1)
note "- CuPy: $CUPY"
note "- torch: $(timeout 60 "$PY" -c "import torch; print(torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" 2>&1 | tail -1)"

# ---- 2. the GPU tests -----------------------------------------------------------------
# the kernels first (fast, and they compile every .cu with NVRTC), then the engine
timeout 240 "$PY" -m pytest -q -rs -x --no-header -p no:cacheprovider tests/test_stage2_gpu.py \
    --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.txt" 2>&1
RC=$?
note "- tests/test_stage2_gpu.py: exit $RC ($( [ $RC = 124 ] && echo 'timed out' || tail -1 "$OUT/gpu_tests.txt")) after $(elapsed) s"
if [ $RC != 0 ]; then
    # -x stopped at the first failure: run the rest without it, so every kernel gets a verdict
    timeout 120 "$PY" -m pytest -q -rs --no-header -p no:cacheprovider tests/test_stage2_gpu.py \
        > "$OUT/gpu_tests_all.txt" 2>&1
    note "- all GPU tests without -x: $(tail -1 "$OUT/gpu_tests_all.txt") after $(elapsed) s"
fi
# ---- 3. the benchmark (what is left of ~7 minutes, at most 330 s) -----------------------
LEFT=$(( 430 - $(elapsed) ))
[ $LEFT -gt 330 ] && LEFT=330
if [ $LEFT -gt 60 ]; then
    timeout $(( LEFT + 20 )) "$PY" -m bench.gpu --out "$OUT" --deadline-s $LEFT $QUICK > "$OUT/bench.txt" 2>&1
    note "- bench.gpu: exit $? after $(elapsed) s"
    cat "$OUT/gpu_bench.md" >> "$SUMMARY" 2>/dev/null || note "(no gpu_bench.md: see bench.txt)"
else
    note "- bench.gpu: skipped, only $LEFT s left"
fi

# ---- 4. the CPU-side stage-2 tests, if time is left (twins, scheduler, engine on cpu) ----
LEFT=$(( 460 - $(elapsed) ))
if [ $LEFT -gt 45 ]; then
    timeout $LEFT "$PY" -m pytest -q --no-header -p no:cacheprovider tests/test_stage2_kernels.py \
        tests/test_stage2_scheduler.py tests/test_stage2_engine.py > "$OUT/cpu_tests.txt" 2>&1
    note "- stage-2 CPU tests: exit $? ($(tail -1 "$OUT/cpu_tests.txt")) after $(elapsed) s"
fi
note "total: $(elapsed) s"
cat "$SUMMARY"
