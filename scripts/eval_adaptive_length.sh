#!/usr/bin/env bash
# Spec-Bench greedy evaluation of the cost-aware draft length (`KIND:auto`, drafters/cost_aware.py) and the
# cost-aware token tree (`hspec:tree`, drafters/block_tree.py) against the same drafters verifying all K
# drafts, on the fastest plain path (--dtype w4a8): plain decoding
# interleaved with every method item by item, SIZE items of each of Spec-Bench's five large tasks, one run per
# entry of EVAL_RUNS, written to results/adaptive_length/<name>.{json,md} (speed = decode phase, prefill excluded;
# every output checked equal to plain decoding). `:auto`'s step costs are measured on this machine at the
# run's start (cached under ~/.cache/hspec/step_costs/) and recorded in the run's settings. A run whose file
# exists is skipped, and `hspec eval` resumes a killed run from its partial file. DRY_RUN=1 prints the commands.
#
# THREADS (default 1) sets torch's threads: on a CPU shared with other processes two threads wait on each
# other at every parallel region behind whatever else runs (a w4a8 verify of ~14 ms took 0.2-2.6 s that way),
# one thread keeps a comparison interleaved item by item honest; on a quiet machine THREADS=2.
#
#   bash scripts/eval_adaptive_length.sh                  # the native drafter (the default), one thread
#   EVAL_RUNS="w4a8:7: w4a8:7:compiled" THREADS=2 bash scripts/eval_adaptive_length.sh
set -euo pipefail
cd "$(dirname "$0")/.."
HSPEC="${HSPEC:-.venv/bin/hspec}"
OUT="${OUT:-results/adaptive_length}"
SIZE="${SIZE:-8}"
TASKS="${TASKS:-translation,summarization,qa,math_reasoning,rag}"
EVAL_RUNS="${EVAL_RUNS:-w4a8:7:}"
THREADS="${THREADS:-1}"
export OMP_NUM_THREADS="$THREADS"
DRAFTERS="${DRAFTERS:-ngram,ngram:auto,hspec,hspec:auto,hspec:tree,hspec+ngram:0.4,hspec+ngram:auto}"
for run in $EVAL_RUNS; do
  IFS=: read -r dtype k compiled <<< "$run"
  name="eval_spec_bench_tasks_k${k}_greedy_${dtype}${compiled:+_compiled}_t${THREADS}"
  cmd="$HSPEC eval --drafters $DRAFTERS --tasks $TASKS --size $SIZE --k $k --max-new-tokens 128 --dtype $dtype"
  cmd="$cmd${compiled:+ --compile-drafter} --out $OUT --name $name"
  if [[ -n "${DRY_RUN:-}" ]]; then echo "+ $cmd"; continue; fi
  if [[ -f "$OUT/$name.json" ]]; then echo "[eval_adaptive_length] $name exists, skipped"; continue; fi
  echo "[eval_adaptive_length] $(date -u +%FT%TZ) $cmd"
  $cmd
done
