#!/usr/bin/env bash
# Builds llama.cpp's `llama-completion` (plain decoding), `llama-speculative-simple` (its
# draft-model and n-gram speculative decoding) and `llama-bench` (its pass times, for the cost
# curve) from the tree vendored in the pinned llama-cpp-python sdist, for the bench's llama.cpp
# rows on the same GGUF files (docs/coder.md).
# Never needed to serve or test.
#
#   scripts/build_llama_cpp.sh            # ~10 minutes on 2 cores; installs into $SPECDEC_CACHE/llama.cpp/bin
#
# On Intel CPUs with AMX, llama.cpp's AMX path dies with SIGILL unless the process asks the kernel
# for tile state, so there the build names AVX-512 explicitly and leaves AMX out.
set -euo pipefail
VERSION=0.3.36
CACHE=${SPECDEC_CACHE:-$HOME/.cache/specdec}
PREFIX=$CACHE/llama.cpp
PYTHON=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
work=$PREFIX/build  # kept: a second run rebuilds only what changed
mkdir -p "$work"

source=$work/llama_cpp_python-$VERSION/vendor/llama.cpp
if [ ! -d "$source" ]; then
    echo "fetching the llama-cpp-python $VERSION sdist (its vendor/llama.cpp)"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
    tar -xzf "$work"/llama_cpp_python-$VERSION.tar.gz -C "$work"
fi

flags=(-DGGML_NATIVE=ON)
if grep -q amx_tile /proc/cpuinfo; then
    flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON
           -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
cmake -S "$source" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \
    "${flags[@]}" >"$work/configure.log" || { tail -40 "$work/configure.log"; exit 1; }
targets=(llama-completion llama-speculative-simple llama-bench)
echo "building ${targets[*]} ($(nproc) jobs; ninja's [done/total] below)"
cmake --build "$work/build" --target "${targets[@]}" -j "$(nproc)"
mkdir -p "$PREFIX/bin"
for target in "${targets[@]}"; do cp "$work/build/bin/$target" "$PREFIX/bin/"; done
echo "$VERSION" >"$PREFIX/VERSION"
echo "installed ${targets[*]} in $PREFIX/bin"
