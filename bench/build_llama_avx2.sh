#!/usr/bin/env bash
# A second llama.cpp, built for an AVX2 CPU (no AVX-512), for `python -m bench cpu --cpu-profile avx2`.
#
# On an AVX-512 host, `pip install llama-cpp-python` compiles llama.cpp with -march=native, so it uses
# AVX-512 (and VNNI / BF16 where present). To stand in for an AVX2-only CPU (AMD Zen 1-3, Intel before
# Ice Lake), the benchmark loads this build instead, through LLAMA_CPP_LIB_PATH: the same
# llama-cpp-python version as the one installed (its Python bindings must match the library), built with
#     -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
# i.e. the instructions of a Haswell, what numba gets with NUMBA_CPU_NAME=haswell.
#
#   bench/build_llama_avx2.sh [DEST]          # default DEST: ~/.cache/qwen3-stages/llama-avx2
#   bench/build_llama_avx2.sh DEST --install  # also pip-install the wheel into this Python's env
#                                             # (on an AVX2-only host this build is the native one)
#
# Output: DEST/lib/libllama.so, libggml*.so (what LLAMA_CPP_LIB_PATH points at) and DEST/wheel/*.whl.
# The sdist comes from PyPI (pip download), or from $LLAMA_SDIST if set (a .tar.gz).
# Time: llama.cpp is ~300 C/C++ files; about 10-20 minutes on 2 idle cores (the multimodal library,
# the tools and the examples are not built). The benchmark never builds it by itself.
set -euo pipefail

DEST=${1:-${QWEN3_STAGES_CACHE:-$HOME/.cache/qwen3-stages}/llama-avx2}
INSTALL=${2:-}
PY=${PYTHON:-python}
mkdir -p "$DEST/wheel" "$DEST/lib" "$DEST/src"

VERSION=$($PY -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))" 2>/dev/null || true)
SDIST=${LLAMA_SDIST:-}
if [ -z "$SDIST" ]; then
    spec="llama-cpp-python${VERSION:+==$VERSION}"
    echo "downloading the sdist of $spec ..."
    # --no-binary for this package only: ":all:" would also build its build tools (cmake) from source
    # (pip reads the sdist's metadata with its build backend: without scikit-build-core in this env, in
    # an isolated build environment)
    $PY -m pip download --no-deps --no-build-isolation --no-binary llama-cpp-python -d "$DEST/src" "$spec" \
        || $PY -m pip download --no-deps --no-binary llama-cpp-python -d "$DEST/src" "$spec"
    SDIST=$(ls -t "$DEST"/src/llama_cpp_python-*.tar.gz | head -1)
fi
echo "building $SDIST for AVX2 (no AVX-512) ..."

export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
 -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF \
 -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
 -DLLAMA_BUILD_SERVER=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
start=$(date +%s)
$PY -m pip wheel --no-deps --no-build-isolation -w "$DEST/wheel" "$SDIST" \
    || $PY -m pip wheel --no-deps -w "$DEST/wheel" "$SDIST"
WHEEL=$(ls -t "$DEST"/wheel/llama_cpp_python-*.whl | head -1)
echo "built $WHEEL in $(( $(date +%s) - start )) s"

# the shared libraries, where LLAMA_CPP_LIB_PATH will point
rm -rf "$DEST/lib" && mkdir -p "$DEST/lib"
$PY - "$WHEEL" "$DEST/lib" <<'EOF'
import sys, zipfile, pathlib
wheel, out = sys.argv[1], pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("llama_cpp/lib/") and not name.endswith("/"):
            (out / pathlib.Path(name).name).write_bytes(z.read(name))
print("libraries:", ", ".join(sorted(p.name for p in out.iterdir())))
EOF
if [ "$INSTALL" = "--install" ]; then
    $PY -m pip install --force-reinstall "$WHEEL"      # its dependencies (diskcache, ...) from the index
fi
echo "use it with: python -m bench cpu --cpu-profile avx2 --llama-avx2-lib $DEST/lib"
