#!/usr/bin/env bash
# bench/gpu_check.sh: everything the GPU stages need a GPU for, in at most 300 s on one H200, so
# that a short loan of a GPU machine verifies it all and leaves time for a rerun. The steps and
# their caps in seconds (docs/stage2.md says why): probe 10 (an interpreter with CuPy, the GPU),
# kernel tests 25 and engine tests 40 (tests/test_stage*_gpu.py with QS_REQUIRE_GPU=1: a skip
# fails), benchmark 115 (python -m bench gpu), lessons 65 (python -m bench lessons --throughput),
# sanitizer 42 (compute-sanitizer memcheck, racecheck on attention), pack 3. The last line says
# PASS only when every step ran whole and passed; FAIL when one failed; otherwise NOT COMPLETE and
# the steps that did not run (or ran out of time), each also "not run" in its own row.
# $OUT receives at most 6 small files (summary.md, logs.tar.gz, gpu_bench.md, gpu_bench.json,
# gpu_tests.xml, host_costs.json), rewritten after each step; models and logs stay in $QS_WORK.
# stdout ends with the failures (trimmed), the summary and the benchmark table.
#
# usage: OUT=DIR bash bench/gpu_check.sh [--dry-run]
#   PYTHON=...       try this interpreter first;   QS_WORK=DIR  the work folder (not inside OUT)
#   QS_CAP_<STEP>=S  a cap (PROBE, KERNELS, ENGINE, BENCH, LESSONS, SANITIZE, PACK)
#   --dry-run        on a CPU: stand-in tests (tests/gpu_check_dry.py), stage 3's GPU kernel tests
#                    on the emulated kernels, the benchmarks on tiny models; caps x QS_DRY_SCALE (5).
#                    What needs a GPU (the engine's GPU tests, compute-sanitizer unless
#                    COMPUTE_SANITIZER names a stand-in) is reported "not run"
# exit: 0 all passed (a dry run: its CPU part); 1 a failure; 2 no interpreter with CuPy, no GPU, or
#       bad arguments; 3 nothing failed, but a step did not run or ran out of time
set -u -o pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
DRY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
    esac
done

# ---- caps, folders ------------------------------------------------------------------
TOTAL=300
CAP_PROBE=${QS_CAP_PROBE:-10} CAP_KERNELS=${QS_CAP_KERNELS:-25} CAP_ENGINE=${QS_CAP_ENGINE:-40}
CAP_BENCH=${QS_CAP_BENCH:-115} CAP_LESSONS=${QS_CAP_LESSONS:-65} CAP_SANITIZE=${QS_CAP_SANITIZE:-42}
CAP_PACK=${QS_CAP_PACK:-3}
SUM=$((CAP_PROBE + CAP_KERNELS + CAP_ENGINE + CAP_BENCH + CAP_LESSONS + CAP_SANITIZE + CAP_PACK))
[ "$SUM" -le "$TOTAL" ] || { echo "gpu_check.sh: the step caps add up to $SUM s, more than $TOTAL s" >&2; exit 2; }
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
for f in summary.md logs.tar.gz gpu_bench.md gpu_bench.json gpu_tests.xml host_costs.json; do rm -f "$OUT/$f"; done
SUMMARY="$OUT/summary.md" LOGS="$WORK/logs" START=$(date +%s) FAILED=0 NOTRUN=""
export OMP_WAIT_POLICY=PASSIVE PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export QS_REQUIRE_GPU=1                      # a skipped GPU test is a failure (tests/conftest.py)

elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "[gpu_check $(elapsed)s] $*"; }
row() { echo "| $1 | $2 | $3 | $4 |" >> "$SUMMARY"; }       # | step | cap | took | result |
pack() {                                     # the logs, small: never the model
    tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs $(cd "$WORK" && ls bench/*.log bench/*.json *.xml 2>/dev/null) \
        2>/dev/null || true
}
stop() { pack; cat "$SUMMARY"; exit 2; }     # the probe failed: nothing else can run
report() { "$PY" tests/gpu_check_report.py "$@"; }   # junit counts, merges, failures
finish() { row "$1" "$2" "$(elapsed)" "$3"; say "$1: $3"; pack; }   # finish STEP CAP RESULT: its row, its line
not_run() { NOTRUN="$NOTRUN${NOTRUN:+; }$1 ($2)"; }          # not_run STEP WHY: the last line names it

{ echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')$( [ "$DRY" = 1 ] && echo ' — DRY RUN on the CPU (stand-in tests)')"
  echo
  echo "Caps add up to $SUM s of $TOTAL$( [ "$SCALE" != 1 ] && echo " (stretched x$SCALE for the dry run)"). Work folder: \`$WORK\`."
  echo; } > "$SUMMARY"

# ---- 1. probe: the interpreter with CuPy, the GPU, the packages ----------------------
NEED=cupy
[ "$DRY" = 1 ] && NEED=numpy                 # the dry run looks for numpy the same way
CANDIDATES=("${PYTHON:-}" python3 python /opt/torch/.venv/bin/python3 /opt/conda/bin/python3
            /usr/local/bin/python3 /usr/bin/python3 "$ROOT/.venv/bin/python" /opt/*/.venv/bin/python3 /opt/*/bin/python3)
PY="" TRIED=()
PROBE_END=$(( $(date +%s) + $(cap "$CAP_PROBE") ))
for c in "${CANDIDATES[@]}"; do
    exe=$(command -v "$c" 2>/dev/null) && [ -n "$c" ] || continue
    case " ${TRIED[*]:-} " in *" $(realpath "$exe") "*) continue ;; esac
    left=$(( PROBE_END - $(date +%s) - 5 ))
    [ "$left" -ge 2 ] || break
    TRIED+=("$(realpath "$exe")")
    if timeout -k 2 "$(( left > 8 ? 8 : left ))" "$exe" -c "import $NEED" >/dev/null 2>&1; then PY=$exe; break; fi
done
if [ -z "$PY" ]; then
    msg="no interpreter with $NEED found (tried: ${TRIED[*]:-none}). On the GPU machine the python3 that holds PyTorch has cupy-cuda13x; set PYTHON=/path/to/python, or install CuPy for CUDA 13 (pip install cupy-cuda13x) where a package index is reachable"
    echo "**probe failed** after $(elapsed) s: $msg" >> "$SUMMARY"
    say "$msg"
    stop
fi
left=$(( PROBE_END - $(date +%s) ))
[ "$left" -ge 3 ] || left=3
timeout -k 2 "$left" "$PY" - "$DRY" > "$LOGS/probe.log" 2>&1 <<'PYEOF'
import importlib.util, platform, sys
need = ["numpy", "numba", "safetensors", "tokenizers", "jinja2", "ml_dtypes", "torch", "transformers", "pytest"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
print(f"python: {sys.executable} {platform.python_version()}")
if importlib.util.find_spec("pytest_timeout") is None:
    print("note: pytest-timeout is missing: no per-test time limit (the step caps still hold)")
if missing:
    sys.exit(print(f"MISSING: {' '.join(missing)}") or 3)
if sys.argv[1] == "1":
    sys.exit(print("gpu: none (dry run)"))
import cupy
if cupy.cuda.runtime.getDeviceCount() < 1:
    sys.exit(print("GPU: CuPy sees no GPU") or 4)
p = cupy.cuda.runtime.getDeviceProperties(0)
x = cupy.arange(1 << 20, dtype=cupy.float32)
k = cupy.RawKernel(r'extern "C" __global__ void twice(float* x, int n)'
                   r'{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= 2.0f; }', "twice")
k(((x.size + 255) // 256,), (256,), (x, cupy.int32(x.size)))
assert float(x[12345]) == 24690.0, "a trivial NVRTC kernel computed the wrong value"
rt = cupy.cuda.runtime
print(f"gpu: {p['name'].decode() if isinstance(p['name'], bytes) else p['name']}, sm_{p['major']}{p['minor']}, "
      f"{p['totalGlobalMem'] / 2**30:.0f} GiB, {p['multiProcessorCount']} SMs; CuPy {cupy.__version__}, CUDA runtime "
      f"{rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}, NVRTC {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))}")
PYEOF
RC=$?
SMI=$(timeout 5 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | head -1)
{ echo "- $(grep '^python:' "$LOGS/probe.log")"
  echo "- $(grep -E '^(gpu|GPU):' "$LOGS/probe.log" || echo 'gpu: (probe gave no answer)')"
  [ -n "$SMI" ] && echo "- nvidia-smi: $SMI"
  grep '^note:' "$LOGS/probe.log" | sed 's/^/- /'
  printf '\n| step | cap (s) | finished at (s) | result |\n|---|---|---|---|\n'; } >> "$SUMMARY"
if [ "$RC" != 0 ]; then
    why=$(grep -E '^(MISSING|GPU):' "$LOGS/probe.log" || tail -3 "$LOGS/probe.log")
    [ "$RC" = 124 ] && why="timed out after $left s"
    row "probe" "$CAP_PROBE" "$(elapsed)" "**failed** with $PY: $why"
    say "probe failed with $PY: $why"
    tail -15 "$LOGS/probe.log"
    stop
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
    # stand-ins under the real conftest (QS_REQUIRE_GPU, time limits); unless QS_DRY_STANDINS=1,
    # stage 3's kernel tests for real on the emulated kernels (the twins' CPU stand-in)
    GPU_TESTS="tests/gpu_check_dry.py" KERNEL_TESTS="tests/gpu_check_dry.py" STAGES=""
    if [ "${QS_DRY_STANDINS:-0}" != 1 ]; then
        KERNEL_TESTS="$KERNEL_TESTS tests/test_stage3_gpu.py" STAGES="stage3"
        export QS_GPU_DRY_RUN=1
    fi
    PYTEST+=(-p conftest --rootdir "$ROOT" -c "$ROOT/pyproject.toml")
    export PYTHONPATH="$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
fi
say "GPU test files: $GPU_TESTS"

# run_step NAME CAP KIND LOG CMD... : one step under its cap, one row of the table. KIND tests:
# pytest with CMD as its arguments, its junit counts the result (and REQUIRE_STAGES: the stages
# that must pass a test); KIND bench: a benchmark (exit 3: a step ran out of time, reported in
# its own row, not a failure) that must leave its table in $OUT
run_step() {
    local name=$1 capv=$2 kind=$3 log=$4; shift 4
    local t=$(cap "$capv") xml="$WORK/$name.xml" cmd=("$@") rc result missing=""
    [ "$kind" = tests ] && cmd=("${PYTEST[@]}" "$@" --junitxml="$xml")
    say "$name (at most $t s) ..."
    timeout -k 3 "$((t - 3))" "${cmd[@]}" > "$LOGS/$log" 2>&1
    rc=$?
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        result="**timed out** after $t s"
        [ "$kind" = tests ] && result="$result (last line: $(tail -1 "$LOGS/$log" | cut -c1-120))"
        FAILED=1
    elif [ "$kind" = tests ]; then
        read -r np nf ne ns < <(report counts "$xml")
        result="$np passed, $nf failed, $ne errors, $ns skipped (pytest exit $rc)"
        [ -n "${REQUIRE_STAGES:-}" ] && missing=$(report stages "$xml" $REQUIRE_STAGES)
        if [ "$rc" != 0 ] || [ "${np:-0}" = 0 ] || [ -n "$missing" ]; then
            result="**${result}**$( [ "${np:-0}" = 0 ] && echo ' — nothing ran')"
            [ -n "$missing" ] && result="$result — no test of $missing passed"
            FAILED=1
        fi
    else
        case "$rc" in
            0) result="ok" ;;
            3) result="**not run in part**: a step ran out of time (see the table)"
               not_run "$name" "a step ran out of time" ;;
            *) result="**a step failed** (exit $rc; see $log)"; FAILED=1 ;;
        esac
    fi
    if [ "$kind" = bench ] && [ ! -f "$OUT/gpu_bench.md" ]; then result="$result; **no table**"; FAILED=1; fi
    finish "$name" "$capv" "$result"
    if [ "$kind" = tests ] && { [ "$rc" = 124 ] || [ "$rc" = 137 ]; }; then tail -15 "$LOGS/$log"; echo; fi
}
# the dry run's engine step runs stand-ins: the engine's GPU tests need a GPU
[ "$DRY" = 1 ] && DRY_NOT_RUN="the engine's GPU tests" || DRY_NOT_RUN=""

# ---- 2. kernel tests, 3. engine tests -------------------------------------------------
REQUIRE_STAGES=$STAGES run_step kernel_tests "$CAP_KERNELS" tests kernel_tests.log $KERNEL_TESTS -k "not engine"
run_step engine_tests "$CAP_ENGINE" tests engine_tests.log $GPU_TESTS -k "engine"

# ---- 4. the benchmark (bench/gpu.py), 5. the lesson ladder (bench/lessons.py) ---------
# (the ladder's --throughput runs on the GPU when CuPy sees one, on bench.gpu's model in
# $WORK/bench: its 18 rungs, 12 sequences each within 3 s, after ~10 s of counting; the dry run:
# the numpy twins, bench.gpu's tiny model, 3 sequences)
DRY_ARG=() SEQS_ARG=(--seqs 12)          # the ladder on a GPU: 12 sequences, 3 s per rung
[ "$DRY" = 1 ] && DRY_ARG=(--dry-run) SEQS_ARG=()
run_step benchmark "$CAP_BENCH" bench bench.log "$PY" -m bench gpu --out "$OUT" --workdir "$WORK/bench" \
    --deadline-s "$(( $(cap "$CAP_BENCH") - 6 ))" "${DRY_ARG[@]}"
T=$(cap "$CAP_LESSONS")
run_step lessons "$CAP_LESSONS" bench lessons.log "$PY" -m bench lessons --layers 1 --save "$WORK/bench/lessons.json" \
    --throughput --workdir "$WORK/bench" --rung-cap-s "$(cap 3)" --deadline-s "$((T - 5))" "${SEQS_ARG[@]}"
{ echo; echo "### Lesson ladder (python -m bench lessons --layers 1 --throughput: host calls counted, tok/s measured)"
  echo; grep '^|' "$LOGS/lessons.log"; } >> "$OUT/gpu_bench.md"

# ---- 6. compute-sanitizer: probe, memcheck, racecheck on attention ----------------------
SAN=${COMPUTE_SANITIZER:-compute-sanitizer}
T=$(cap "$CAP_SANITIZE")
SAN_END=$(( $(date +%s) + T ))
probe_cmd=("$PY" -c "import cupy; x = cupy.arange(8, dtype=cupy.float32); print(float((x * 2).sum()))")
[ "$DRY" = 1 ] && probe_cmd=("$PY" -c "print(56.0)")
if [ "$DRY" = 1 ] && [ -z "${COMPUTE_SANITIZER:-}" ]; then
    results="**not run**: it needs a GPU (COMPUTE_SANITIZER=a stand-in runs the step's plumbing)"
    DRY_NOT_RUN="$DRY_NOT_RUN, compute-sanitizer"
elif ! command -v "$SAN" >/dev/null 2>&1; then
    results="**not run**: compute-sanitizer is not installed"
    not_run sanitizer "not installed"
elif ! timeout -k 2 "$(( T / 4 ))" "$SAN" --tool memcheck --error-exitcode 9 "${probe_cmd[@]}" \
        > "$LOGS/sanitizer_probe.log" 2>&1 || ! grep -q '^56.0' "$LOGS/sanitizer_probe.log"; then
    why=$(grep -m1 -iE 'not supported|error|unable' "$LOGS/sanitizer_probe.log" | cut -c1-160)
    results="**not run**: compute-sanitizer refuses this machine (${why:-the probe failed or timed out})"
    not_run sanitizer "refused by this machine"
else
    results=""
    for tool in memcheck racecheck; do
        sel=(-m sanitize)                    # the dry run: the kernel stand-in, under both tools
        [ "$tool" = racecheck ] && sel+=(-k attention)
        [ "$DRY" = 1 ] && sel=(-k kernel_stand_in_passes)
        left=$(( SAN_END - $(date +%s) ))
        [ "$tool" = memcheck ] && left=$(( left * 2 / 3 ))
        if [ "$left" -lt 5 ]; then
            results="$results **$tool: not run** (no time left);"; not_run sanitizer "$tool: no time left"; continue
        fi
        timeout -k 2 "$((left - 2))" "$SAN" --tool "$tool" --error-exitcode 9 --print-limit 20 \
            "${PYTEST[@]}" $GPU_TESTS "${sel[@]}" --junitxml="$WORK/sanitize_$tool.xml" > "$LOGS/sanitize_$tool.log" 2>&1
        RC=$?
        read -r np nf ne ns < <(report counts "$WORK/sanitize_$tool.xml")
        case "$RC" in
            0) results="$results $tool: clean ($np tests);" ;;
            124|137) results="$results **$tool: timed out** after $left s ($np tests done);"
                     not_run sanitizer "$tool timed out after $left s" ;;
            9) results="$results **$tool: errors found** (see sanitize_$tool.log);"; FAILED=1 ;;
            *) results="$results **$tool: exit $RC** ($nf failed);"; FAILED=1 ;;
        esac
    done
fi
finish sanitizer "$CAP_SANITIZE" "${results# }"

# ---- 7. pack: one junit file, the logs, the check of $OUT ------------------------------
XMLS=$(ls "$WORK"/*.xml 2>/dev/null | tr '\n' ' ')
totals="no junit file"
[ -n "$XMLS" ] && totals=$(report junit "$OUT/gpu_tests.xml" $XMLS)
pack
problems=$(report check-out "$OUT" 6)
if [ -n "$problems" ]; then
    row "pack" "$CAP_PACK" "$(elapsed)" "**$OUT would not come back whole**: $problems"
    FAILED=1
else
    row "pack" "$CAP_PACK" "$(elapsed)" "ok: $(ls "$OUT" | wc -l) files in OUT"
fi
# the verdict: PASS only when every step ran whole; a step that did not is named, never passed over
if [ "$FAILED" != 0 ]; then
    verdict="FAIL${NOTRUN:+ (and not run: $NOTRUN)}"
elif [ -n "$NOTRUN" ]; then
    verdict="NOT COMPLETE: nothing failed, but not run: $NOTRUN"
elif [ "$DRY" = 1 ]; then
    verdict="PASS on the CPU (a dry run); not run, they need a GPU: ${DRY_NOT_RUN}"
else
    verdict=PASS
fi
printf '\nAll tests: %s. Total: %s s of %s%s.\nResult: %s\n' "$totals" "$(elapsed)" "$TOTAL" \
    "$( [ "$SCALE" != 1 ] && echo " x$SCALE")" "$verdict" >> "$SUMMARY"
cp "$SUMMARY" "$LOGS/summary.md"             # a last pack, so logs.tar.gz holds the finished summary
pack

# ---- stdout: the failures (trimmed), the summary, the benchmark table -------------------
# (in this order: the device tool returns the last 12,000 characters of the output)
fails=$( [ -f "$OUT/gpu_tests.xml" ] && report failures "$OUT/gpu_tests.xml" 25)
if [ -n "$fails" ]; then
    printf '\n%s failures %s\n' "===============================" "================================"
    echo "$fails" | head -120
    [ "$(echo "$fails" | wc -l)" -gt 120 ] && echo "... (more in gpu_tests.xml and logs.tar.gz)"
fi
printf '\n%s summary %s\n' "================================" "================================"
cat "$SUMMARY"
if [ -f "$OUT/gpu_bench.md" ]; then
    printf '\n%s benchmark %s\n' "===============================" "==============================="
    cat "$OUT/gpu_bench.md"
fi
[ "$FAILED" != 0 ] && exit 1
[ -n "$NOTRUN" ] && exit 3
exit 0
