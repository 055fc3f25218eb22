#!/usr/bin/env bash
# Build llama.cpp's own llama-cli, llama-server and llama-bench once, from the source llama-cpp-python
# vendors (its October 2026 build drafts with DFlash/DSpark: docs/llama-cpp.md), native CPU flags (less
# AMX on an AMX CPU, below).
#
#   bash scripts/build_llama_cpp.sh            # builds into $HSPEC_CACHE/llama.cpp/<version>/ (default ~/.cache/hspec)
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 JOBS=2 bash scripts/build_llama_cpp.sh
#
# Skips the build when the three binaries are already there; prints the bin folder on its last line.
# About 8-30 minutes on 2 cores (it runs under nice -n 19). hspec finds the binaries there by itself
# (hspec.integrations.llama_cpp.binaries); $HSPEC_LLAMA_CPP_BIN points it at another build.
set -euo pipefail

version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
jobs="${JOBS:-$(nproc)}"
root="${HSPEC_CACHE:-$HOME/.cache/hspec}/llama.cpp/$version"
bin="$root/src/build/bin"
targets=(llama-cli llama-server llama-bench)
python="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[ -x "$python" ] || python=python3

if [ -x "$bin/llama-cli" ] && [ -x "$bin/llama-server" ] && [ -x "$bin/llama-bench" ]; then
  echo "llama.cpp $version already built" >&2
  echo "$bin"
  exit 0
fi

mkdir -p "$root"
if [ ! -f "$root/src/CMakeLists.txt" ]; then
  # The sdist is llama-cpp-python's, whose vendor/llama.cpp is the llama.cpp source it pins.
  "$python" -m pip download --no-deps --no-binary :all: --dest "$root/sdist" "llama-cpp-python==$version" >&2
  tar -xzf "$root/sdist/llama_cpp_python-$version.tar.gz" -C "$root"
  rm -rf "$root/src"
  mv "$root/llama_cpp_python-$version/vendor/llama.cpp" "$root/src"
  rm -rf "$root/llama_cpp_python-$version"
fi

cd "$root/src"
# Native CPU flags, except on an AMX CPU: ggml's AMX backend dies there with SIGILL in its Q4_1 x Q8_1 tile
# kernel (tinygemm_kernel_amx, the first prompt batch; ggml-org/llama.cpp issue 20824), so the build names
# the same flags without AMX (docs/fast-path.md#an-amx-host: llama-cpp-python's build does the same).
cpu_flags=(-DGGML_NATIVE=ON)
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON
             -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
             -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  echo "AMX CPU: building without ggml's AMX backend" >&2
fi
# No tests, examples or curl: the three tools are all hspec drives. Shared libraries, found through the
# binaries' RPATH in build/bin.
nice -n 19 cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${cpu_flags[@]}" -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
nice -n 19 cmake --build build -j "$jobs" --target "${targets[@]}" >&2
echo "built llama.cpp from llama-cpp-python $version: $("$bin/llama-server" --version 2>&1 | tr '\n' ' ')" >&2
echo "$bin"
