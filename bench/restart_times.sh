#!/usr/bin/env bash
# How long stage 1 takes to restart after an edit (docs/benchmarks.md, "Restarts after an edit").
# In a copy of the tracked files, with a fresh numba cache per kernels choice, the chat runs to its
# banner and exits (stdin empty): cold, warm, after a one-line edit to the RMSNorm kernel, warm,
# after one to the int8 matmul kernel, warm, after one to ops.py and one to chat.py (no numba code).
# Each line: wall and user+sys CPU seconds, the chat's own "compiled kernels in" figure, the load.
#     bash bench/restart_times.sh            # QUANT=int8 KERNELS="plain fast" by default
set -u
SRC=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d); (cd "$SRC" && git ls-files -z | xargs -0 cp --parents -t "$W")
cd "$W"
export PYTHONPATH=$W OMP_WAIT_POLICY=PASSIVE
Q=${QUANT:-int8}
run() {  # label, kernels
  /usr/bin/time -f "%e %U %S" -o "$W/time" python -m stage1_cpu.chat --quant "$Q" --kernels "$2" < /dev/null > "$W/out" 2>&1
  read -r e u s < "$W/time"
  comp=$(grep -o "compiled kernels in [0-9.]* s" "$W/out" | grep -o "[0-9.]*" || echo "-")
  printf "%-28s %-6s wall %6.1f s  user+sys %6.1f s  warm-up %s s  load %s\n" "$1" "$2" "$e" \
    "$(echo "$u + $s" | bc)" "$comp" "$(cut -d' ' -f1-3 /proc/loadavg)"
}
for K in ${KERNELS:-plain fast}; do
  export NUMBA_CACHE_DIR=$(mktemp -d)
  run "cold" "$K"
  run "warm" "$K"
  sed -i 's/^    ss = np.float32(0.0)$/    ss = np.float32(0.0)  # the sum of squares/' stage1_cpu/norms.py
  run "after an rmsnorm edit" "$K"
  run "warm" "$K"
  sed -i 's/^        part = np.float32(0.0)$/        part = np.float32(0.0)  # this group'"'"'s sum/' stage1_cpu/matmul.py
  run "after an int8 matmul edit" "$K"
  run "warm" "$K"
  sed -i 's/^    var = np.mean(x \* x, axis=-1, keepdims=True)/&  # mean square/' stage1_cpu/ops.py
  run "after an ops.py edit" "$K"
  sed -i 's/^def build_engine(folder, args):/& # the engine for the chat/' stage1_cpu/chat.py
  run "after a chat.py edit" "$K"
  (cd "$SRC" && git ls-files -z stage1_cpu | xargs -0 cp --parents -t "$W")   # undo the edits
done
