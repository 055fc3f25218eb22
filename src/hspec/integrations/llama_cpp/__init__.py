"""hspec beside llama.cpp (the build llama-cpp-python 0.3.36 vendors; docs/llama-cpp.md).

- `export`: hspec's DFlash and DSpark checkpoints as the one-file GGUF llama.cpp's `draft-dspark` type loads;
- `binaries`: find the `llama-server` / `llama-bench` that scripts/build_llama_cpp.sh built, run greedy
  completions through the server and read llama.cpp's own timings and draft counters.

Nothing here imports llama-cpp-python: the binaries are driven as processes.
"""
