#!/usr/bin/env bash
# Spec-Bench greedy evaluation of the shipped drafters in each fast-path dtype (docs/fast-path.md):
# the issue's 24 items, plain decoding interleaved with every method, one run per (dtype, K), written
# to results/fast_path/eval_spec_bench_k<K>_greedy_<dtype>[_compiled][_drafter_<precision>].{json,md}.
# A run spelled DTYPE:K:compiled runs the drafters' tensor-only forwards through torch.compile
# (--compile-drafter); a fourth field sets --drafter-precision (DTYPE:K::floating,
# DTYPE:K:compiled:floating; empty = auto: int8 drafter weights under a bf16 or int8 target on a CPU). A run
# whose file exists is skipped, so the script resumes after an interruption. DRY_RUN=1 prints the
# commands only.
#
#   bash scripts/eval_fast_path.sh       # bfloat16 K=7, the same compiled, compiled with floating
#                                        # drafters, int8 K=7, int8 K=3
#   EVAL_RUNS="bfloat16:7" bash scripts/eval_fast_path.sh
set -euo pipefail
cd "$(dirname "$0")/.."
HSPEC="${HSPEC:-.venv/bin/hspec}"
OUT="${OUT:-results/fast_path}"
EVAL_RUNS="${EVAL_RUNS:-bfloat16:7 bfloat16:7:compiled bfloat16:7:compiled:floating int8:7 int8:3}"
DRAFTERS="${DRAFTERS:-ngram,hspec,hspec+ngram,hspec:0.4,hspec+ngram:0.4}"
for run in $EVAL_RUNS; do
  IFS=: read -r dtype k compiled precision <<< "$run"
  name="eval_spec_bench_k${k}_greedy_${dtype}${compiled:+_compiled}${precision:+_drafter_$precision}"
  cmd="$HSPEC eval --drafters $DRAFTERS --tasks spec_bench --size 24 --k $k --max-new-tokens 128 --dtype $dtype"
  cmd="$cmd${compiled:+ --compile-drafter}${precision:+ --drafter-precision $precision} --out $OUT --name $name"
  if [[ -n "${DRY_RUN:-}" ]]; then echo "+ $cmd"; continue; fi
  if [[ -f "$OUT/$name.json" ]]; then echo "[eval_fast_path] $name exists, skipped"; continue; fi
  echo "[eval_fast_path] $(date -u +%FT%TZ) $cmd"
  $cmd
done
