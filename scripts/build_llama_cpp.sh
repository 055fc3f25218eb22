#!/usr/bin/env bash
# Build llama.cpp's own llama-cli, llama-server and llama-bench once, from the source llama-cpp-python
# vendors (its October 2026 build drafts with DFlash/DSpark: docs/llama-cpp.md), native CPU flags.
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
# No tests, examples or curl: the three tools are all hspec drives. Shared libraries, found through the
# binaries' RPATH in build/bin.
nice -n 19 cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
nice -n 19 cmake --build build -j "$jobs" --target "${targets[@]}" >&2
echo "built llama.cpp from llama-cpp-python $version: $("$bin/llama-server" --version 2>&1 | tr '\n' ' ')" >&2
echo "$bin"
