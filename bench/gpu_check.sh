#!/usr/bin/env bash
# bench/gpu_check.sh — everything the GPU stages need a GPU for, in one run of at most 300 s on
# one H200, so that a short loan of a GPU machine verifies it all and leaves time for a rerun.
# Each step has a time cap (docs/stage2.md lists them and why), and the caps add up:
#   probe 10 s          the interpreter with CuPy, the GPU, the packages; none: stop in seconds
#   kernel tests 25 s   tests/test_stage*_gpu.py -k "not engine", with QS_REQUIRE_GPU=1 (a skip
#                       fails, so does a stage none of whose tests passed)
#   engine tests 45 s   tests/test_stage*_gpu.py -k engine (CUDA graphs captured and replayed)
#   benchmark 130 s     python -m bench gpu (stage 3's targets, host costs per call)
#   lessons 75 s        python -m bench lessons --layers 1 --throughput (the ladder, timed)
#   sanitizer 12 s      compute-sanitizer memcheck (`sanitize` tests), racecheck (attention)
#   pack 3 s            one junit file, one log archive, the summary
# $OUT receives at most 6 small files (summary.md, logs.tar.gz, gpu_bench.md, gpu_bench.json,
# gpu_tests.xml, host_costs.json); models and per-step logs stay in $QS_WORK (default
# $TMPDIR/qs-gpu-check). The failures (trimmed), the summary and the benchmark table go to
# stdout too; summary.md and logs.tar.gz are rewritten after each step.
#
# usage: OUT=DIR bash bench/gpu_check.sh [--dry-run]
#   PYTHON=...        try this interpreter first;  QS_WORK=DIR  the work folder (not inside OUT)
#   QS_CAP_<STEP>=S   override a cap (PROBE, KERNELS, ENGINE, BENCH, LESSONS, SANITIZE, PACK)
#   --dry-run         on a CPU: the same steps and plumbing with stand-in tests
#                     (tests/gpu_check_dry.py), stage 3's GPU kernel tests on the emulated
#                     kernels (QS_GPU_DRY_RUN=1; QS_DRY_STANDINS=1 leaves them out) and the
#                     benchmarks on tiny models; caps stretched by QS_DRY_SCALE (default 5)
# exit: 0 all passed; 1 a test failed, a step broke or $OUT would not come back whole;
#       2 no interpreter with CuPy, no GPU, or bad arguments
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DRY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done

# ---- caps, folders ------------------------------------------------------------------
TOTAL=300
CAP_PROBE=${QS_CAP_PROBE:-10}
CAP_KERNELS=${QS_CAP_KERNELS:-25}
CAP_ENGINE=${QS_CAP_ENGINE:-45}
CAP_BENCH=${QS_CAP_BENCH:-130}
CAP_LESSONS=${QS_CAP_LESSONS:-75}
CAP_SANITIZE=${QS_CAP_SANITIZE:-12}
CAP_PACK=${QS_CAP_PACK:-3}
SUM=$((CAP_PROBE + CAP_KERNELS + CAP_ENGINE + CAP_BENCH + CAP_LESSONS + CAP_SANITIZE + CAP_PACK))
if [ "$SUM" -gt "$TOTAL" ]; then
    echo "gpu_check.sh: the step caps add up to $SUM s, more than $TOTAL s" >&2
    exit 2
fi
SCALE=1
[ "$DRY" = 1 ] && SCALE=${QS_DRY_SCALE:-5}
cap() { echo $(( $1 * SCALE )); }

OUT=$(realpath -m "${OUT:-$ROOT/gpu_results}")
WORK=$(realpath -m "${QS_WORK:-${TMPDIR:-/tmp}/qs-gpu-check}")
case "$WORK/" in
    "$OUT"/*) echo "gpu_check.sh: the work folder $WORK is inside OUT ($OUT); set QS_WORK elsewhere" >&2
              exit 2 ;;
esac
mkdir -p "$OUT" "$WORK"
rm -rf "$WORK/logs" "$WORK/bench"/*.log "$WORK/bench"/*.json "$WORK"/*.xml "$WORK/dry"
mkdir -p "$WORK/logs" "$WORK/bench"
OUT_FILES="summary.md logs.tar.gz gpu_bench.md gpu_bench.json gpu_tests.xml host_costs.json"
for f in $OUT_FILES; do rm -f "$OUT/$f"; done
SUMMARY="$OUT/summary.md"
LOGS="$WORK/logs"
START=$(date +%s)
FAILED=0
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export QS_REQUIRE_GPU=1                      # a skipped GPU test is a failure (tests/conftest.py)

elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "[gpu_check $(elapsed)s] $*"; }
# the step table: | step | cap | took | result |
row() { echo "| $1 | $2 | $3 | $4 |" >> "$SUMMARY"; }
pack() {                                     # the logs, small: never the model
    tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs $(cd "$WORK" && ls bench/*.log bench/*.json *.xml 2>/dev/null) \
        2>/dev/null || true
}

{
    echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')$( [ "$DRY" = 1 ] && echo ' — DRY RUN on the CPU (stand-in tests)')"
    echo
    echo "Caps add up to $SUM s of $TOTAL$( [ "$SCALE" != 1 ] && echo " (stretched x$SCALE for the dry run)"). Work folder: \`$WORK\`."
    echo
} > "$SUMMARY"

# ---- 1. probe: the interpreter with CuPy, the GPU, the packages ----------------------
NEED=cupy
[ "$DRY" = 1 ] && NEED=numpy                 # the dry run looks for numpy the same way
CANDIDATES=("${PYTHON:-}" python3 python /opt/torch/.venv/bin/python3 /opt/conda/bin/python3
            /usr/local/bin/python3 /usr/bin/python3 "$ROOT/.venv/bin/python")
for p in /opt/*/.venv/bin/python3 /opt/*/bin/python3; do CANDIDATES+=("$p"); done
PY=""
TRIED=()
PROBE_END=$(( $(date +%s) + $(cap "$CAP_PROBE") ))
declare -A SEEN=()
for c in "${CANDIDATES[@]}"; do
    [ -n "$c" ] || continue
    exe=$(command -v "$c" 2>/dev/null) || continue
    real=$(realpath "$exe" 2>/dev/null) || continue
    [ -z "${SEEN[$real]:-}" ] || continue
    SEEN[$real]=1
    left=$(( PROBE_END - $(date +%s) - 5 ))
    [ "$left" -ge 2 ] || break
    [ "$left" -gt 8 ] && left=8
    TRIED+=("$exe")
    if timeout -k 2 "$left" "$exe" -c "import $NEED" >/dev/null 2>&1; then PY=$exe; break; fi
done
if [ -z "$PY" ]; then
    msg="no interpreter with $NEED found (tried: ${TRIED[*]:-none}). On the GPU machine the python3 that holds PyTorch has cupy-cuda13x; set PYTHON=/path/to/python, or install CuPy for CUDA 13 (pip install cupy-cuda13x) where a package index is reachable"
    echo "**probe failed** after $(elapsed) s: $msg" >> "$SUMMARY"
    say "$msg"
    pack
    cat "$SUMMARY"
    exit 2
fi
left=$(( PROBE_END - $(date +%s) ))
[ "$left" -ge 3 ] || left=3
timeout -k 2 "$left" "$PY" - "$DRY" > "$LOGS/probe.log" 2>&1 <<'PYEOF'
import importlib.util, platform, sys
dry = sys.argv[1] == "1"
need = ["numpy", "numba", "safetensors", "tokenizers", "jinja2", "ml_dtypes", "torch", "transformers", "pytest"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
print(f"python: {sys.executable} {platform.python_version()}")
if importlib.util.find_spec("pytest_timeout") is None:
    print("note: pytest-timeout is missing: no per-test time limit (the step caps still hold)")
if missing:
    print(f"MISSING: {' '.join(missing)}")
    sys.exit(3)
if dry:
    print("gpu: none (dry run)")
    sys.exit(0)
import cupy
n = cupy.cuda.runtime.getDeviceCount()
if n < 1:
    print("GPU: CuPy sees no GPU")
    sys.exit(4)
props = cupy.cuda.runtime.getDeviceProperties(0)
name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
x = cupy.arange(1 << 20, dtype=cupy.float32)
k = cupy.RawKernel(r'extern "C" __global__ void twice(float* x, int n)'
                   r'{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= 2.0f; }', "twice")
k(((x.size + 255) // 256,), (256,), (x, cupy.int32(x.size)))
assert float(x[12345]) == 24690.0, "a trivial NVRTC kernel computed the wrong value"
print(f"gpu: {name}, sm_{props['major']}{props['minor']}, {props['totalGlobalMem'] / 2**30:.0f} GiB, "
      f"{props['multiProcessorCount']} SMs; CuPy {cupy.__version__}, CUDA runtime "
      f"{cupy.cuda.runtime.runtimeGetVersion()}, driver {cupy.cuda.runtime.driverGetVersion()}, "
      f"NVRTC {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}")
PYEOF
RC=$?
SMI=$(timeout 5 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | head -1)
{
    echo "- $(grep '^python:' "$LOGS/probe.log")"
    echo "- $(grep -E '^(gpu|GPU):' "$LOGS/probe.log" || echo 'gpu: (probe gave no answer)')"
    [ -n "$SMI" ] && echo "- nvidia-smi: $SMI"
    grep '^note:' "$LOGS/probe.log" | sed 's/^/- /'
    echo
    echo "| step | cap (s) | finished at (s) | result |"
    echo "|---|---|---|---|"
} >> "$SUMMARY"
if [ "$RC" != 0 ]; then
    why=$(grep -E '^(MISSING|GPU):' "$LOGS/probe.log" || tail -3 "$LOGS/probe.log")
    [ "$RC" = 124 ] && why="timed out after $left s"
    row "probe" "$CAP_PROBE" "$(elapsed)" "**failed** with $PY: $why"
    say "probe failed with $PY: $why"
    tail -15 "$LOGS/probe.log"
    pack
    cat "$SUMMARY"
    exit 2
fi
row "probe" "$CAP_PROBE" "$(elapsed)" "ok: $PY"
say "probe ok: $PY"

# ---- the tests: per stage, found by name ----------------------------------------------
GPU_TESTS=$(ls tests/test_stage*_gpu.py 2>/dev/null | tr '\n' ' ')
KERNEL_TESTS=$GPU_TESTS
# the stages whose kernel tests must pass (stage2 stage3): from the GPU stages' folders
STAGES=$(for d in stage*/cuda; do [ -d "$d" ] && basename "$(dirname "$d")" | cut -d_ -f1; done | tr '\n' ' ')
PYTEST=("$PY" -m pytest -q -rfE --no-header -p no:cacheprovider -o console_output_style=classic)
if [ "$DRY" = 1 ]; then
    # stand-ins (tests/gpu_check_dry.py) under the real conftest: QS_REQUIRE_GPU, time limits
    GPU_TESTS="tests/gpu_check_dry.py"
    KERNEL_TESTS=$GPU_TESTS
    STAGES=""
    if [ "${QS_DRY_STANDINS:-0}" != 1 ]; then
        # stage 3's kernel tests for real, on the emulated kernels (the twins' CPU stand-in)
        KERNEL_TESTS="$KERNEL_TESTS tests/test_stage3_gpu.py"
        STAGES="stage3"
        export QS_GPU_DRY_RUN=1
    fi
    PYTEST+=(-p conftest --rootdir "$ROOT" -c "$ROOT/pyproject.toml")
    export PYTHONPATH="$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
fi
say "GPU test files: $GPU_TESTS"

# run_tests NAME CAP PYTEST-ARGS... : one pytest run under its cap, one row of the table
run_tests() {
    local name=$1 capv=$2; shift 2
    local t=$(cap "$capv") xml="$WORK/$name.xml" rc result
    say "$name (at most $t s) ..."
    timeout -k 3 "$((t - 3))" "${PYTEST[@]}" "$@" --junitxml="$xml" > "$LOGS/$name.log" 2>&1
    rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        result="**timed out** after $t s (last line: $(tail -1 "$LOGS/$name.log" | cut -c1-120))"
        FAILED=1
    else
        read -r np nf ne ns < <("$PY" bench/gpu_check_report.py counts "$xml")
        result="$np passed, $nf failed, $ne errors, $ns skipped (pytest exit $rc)"
        missing=""
        [ -n "${REQUIRE_STAGES:-}" ] && missing=$("$PY" bench/gpu_check_report.py stages "$xml" $REQUIRE_STAGES)
        if [ "$rc" != 0 ] || [ "${np:-0}" = 0 ] || [ -n "$missing" ]; then
            result="**${result}**"
            [ "${np:-0}" = 0 ] && result="$result — nothing ran"
            [ -n "$missing" ] && result="$result — no test of $missing passed"
            FAILED=1
        fi
    fi
    row "$name" "$capv" "$(elapsed)" "$result"
    say "$name: $result"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then tail -15 "$LOGS/$name.log"; echo; fi
    pack
}

# ---- 2. kernel tests, 3. engine tests -------------------------------------------------
REQUIRE_STAGES=$STAGES run_tests kernel_tests "$CAP_KERNELS" $KERNEL_TESTS -k "not engine"
run_tests engine_tests "$CAP_ENGINE" $GPU_TESTS -k "engine"

# run_bench NAME CAP LOG CMD... : a benchmark under its cap, one row of the table (exit 3: a
# step ran out of time, reported in its own row, not a failure)
run_bench() {
    local name=$1 capv=$2 log=$3; shift 3
    local t=$(cap "$capv") rc result
    say "$name (at most $t s) ..."
    timeout -k 3 "$((t - 3))" "$@" > "$LOGS/$log" 2>&1
    rc=$?
    case "$rc" in
        0) result="ok" ;;
        3) result="ok, but a step ran out of time (see the table)" ;;
        124|137) result="**timed out** after $t s"; FAILED=1 ;;
        *) result="**a step failed** (exit $rc; see $log)"; FAILED=1 ;;
    esac
    [ -f "$OUT/gpu_bench.md" ] || { result="$result; **no table**"; FAILED=1; }
    row "$name" "$capv" "$(elapsed)" "$result"
    say "$name: $result"
    pack
}

# ---- 4. the benchmark (bench/gpu.py), 5. the lesson ladder (bench/lessons.py) ---------
# (the ladder's --throughput runs on the GPU when CuPy sees one, on bench.gpu's model in
# $WORK/bench; the dry run: the numpy twins, bench.gpu's tiny model, 3 sequences)
DRY_ARG=()
[ "$DRY" = 1 ] && DRY_ARG=(--dry-run)
run_bench benchmark "$CAP_BENCH" bench.log "$PY" -m bench gpu --out "$OUT" --workdir "$WORK/bench" \
    --deadline-s "$(( $(cap "$CAP_BENCH") - 6 ))" "${DRY_ARG[@]}"
T=$(cap "$CAP_LESSONS")
run_bench lessons "$CAP_LESSONS" lessons.log "$PY" -m bench lessons --layers 1 --save "$WORK/bench/lessons.json" \
    --throughput --workdir "$WORK/bench" --rung-cap-s "$(cap 7)" --deadline-s "$((T - 5))"
{ echo; echo "### Lesson ladder (python -m bench lessons --layers 1 --throughput: host calls counted, tok/s measured)"
  echo; grep '^|' "$LOGS/lessons.log"; } >> "$OUT/gpu_bench.md"

# ---- 6. compute-sanitizer: probe, memcheck, racecheck on attention ----------------------
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
T=$(cap "$CAP_SANITIZE")
SAN_END=$(( $(date +%s) + T ))
if ! command -v "$SAN" >/dev/null 2>&1; then
    row "sanitizer" "$CAP_SANITIZE" "$(elapsed)" "not run: compute-sanitizer is not installed"
    say "sanitizer: not installed"
else
    probe_cmd=("$PY" -c "import cupy; x = cupy.arange(8, dtype=cupy.float32); print(float((x * 2).sum()))")
    [ "$DRY" = 1 ] && probe_cmd=("$PY" -c "print(56.0)")
    timeout -k 2 "$(( T / 4 ))" "$SAN" --tool memcheck --error-exitcode 9 "${probe_cmd[@]}" \
        > "$LOGS/sanitizer_probe.log" 2>&1
    RC=$?
    if [ "$RC" != 0 ] || ! grep -q '^56.0' "$LOGS/sanitizer_probe.log"; then
        why=$(grep -m1 -iE 'not supported|error|unable' "$LOGS/sanitizer_probe.log" | cut -c1-160)
        [ "$RC" = 124 ] && why="the probe timed out"
        row "sanitizer" "$CAP_SANITIZE" "$(elapsed)" "not run: compute-sanitizer refuses this machine (${why:-exit $RC})"
        say "sanitizer refused: ${why:-exit $RC}"
    else
        SAN_TESTS=(-m sanitize)
        [ "$DRY" = 1 ] && SAN_TESTS=(-k "kernel_stand_in_passes")
        results=""
        for tool in memcheck racecheck; do
            sel=()
            [ "$tool" = racecheck ] && sel=(-k "attention")
            [ "$DRY" = 1 ] && sel=()
            left=$(( SAN_END - $(date +%s) ))
            [ "$tool" = memcheck ] && left=$(( left * 2 / 3 ))
            if [ "$left" -lt 5 ]; then results="$results $tool: no time left;"; continue; fi
            timeout -k 2 "$((left - 2))" "$SAN" --tool "$tool" --error-exitcode 9 --print-limit 20 \
                "${PYTEST[@]}" $GPU_TESTS "${SAN_TESTS[@]}" "${sel[@]}" --junitxml="$WORK/sanitize_$tool.xml" \
                > "$LOGS/sanitize_$tool.log" 2>&1
            RC=$?
            read -r np nf ne ns < <("$PY" bench/gpu_check_report.py counts "$WORK/sanitize_$tool.xml")
            case "$RC" in
                0) results="$results $tool: clean ($np tests);" ;;
                124|137) results="$results $tool: timed out after $left s ($np tests done);" ;;
                9) results="$results **$tool: errors found** (see sanitize_$tool.log);"; FAILED=1 ;;
                *) results="$results **$tool: exit $RC** ($nf failed);"; FAILED=1 ;;
            esac
        done
        row "sanitizer" "$CAP_SANITIZE" "$(elapsed)" "${results# }"
        say "sanitizer:$results"
    fi
fi
pack

# ---- 7. pack: one junit file, the logs, the check of $OUT ------------------------------
XMLS=$(ls "$WORK"/*.xml 2>/dev/null | tr '\n' ' ')
if [ -n "$XMLS" ]; then
    totals=$("$PY" bench/gpu_check_report.py junit "$OUT/gpu_tests.xml" $XMLS)
else
    totals="no junit file"
fi
pack
problems=$("$PY" bench/gpu_check_report.py check-out "$OUT" 6)
if [ -n "$problems" ]; then
    row "pack" "$CAP_PACK" "$(elapsed)" "**$OUT would not come back whole**: $problems"
    FAILED=1
else
    row "pack" "$CAP_PACK" "$(elapsed)" "ok: $(ls "$OUT" | wc -l) files in OUT"
fi
{
    echo
    echo "All tests: $totals. Total: $(elapsed) s of $TOTAL$( [ "$SCALE" != 1 ] && echo " x$SCALE")."
    echo "Result: $( [ "$FAILED" = 0 ] && echo PASS || echo FAIL )"
} >> "$SUMMARY"
# a last pack, so logs.tar.gz holds the finished summary too
cp "$SUMMARY" "$LOGS/summary.md"
pack

# ---- stdout: the failures (trimmed), the summary, the benchmark table -------------------
# (in this order: the device tool returns the last 12,000 characters of the output, so the
# failures are cut to 120 lines and the summary and the table come last)
if [ -f "$OUT/gpu_tests.xml" ]; then
    fails=$("$PY" bench/gpu_check_report.py failures "$OUT/gpu_tests.xml" 25)
    if [ -n "$fails" ]; then
        echo
        echo "=============================== failures ================================"
        echo "$fails" | head -120
        [ "$(echo "$fails" | wc -l)" -gt 120 ] && echo "... (more in gpu_tests.xml and logs.tar.gz)"
    fi
fi
echo
echo "================================ summary ================================"
cat "$SUMMARY"
if [ -f "$OUT/gpu_bench.md" ]; then
    echo
    echo "=============================== benchmark ==============================="
    cat "$OUT/gpu_bench.md"
fi
exit "$FAILED"
