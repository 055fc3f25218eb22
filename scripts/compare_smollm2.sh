#!/usr/bin/env bash
# The comparison of every drafter kind and ablation on the embedded default target (SmolLM2-135M-Instruct):
# each trained with the same recipe, data, draft vocabulary and steps, then evaluated interleaved with
# plain decoding. Resumable at every step: rerun the script after a kill. Results go to results/comparison/.
#
# Needs the feature caches of scripts/train_hspec_smollm2.sh (steps 1-2). About 4 CPU-hours on a
# 2-core machine with the defaults; STEPS, KINDS, LANES, VAL_EVERY and EVAL_SIZE
# override (the committed results/comparison/ states the values it was run with). On a GPU, run it unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
HSPEC=.venv/bin/hspec
STEPS=${STEPS:-700}
VAL_EVERY=${VAL_EVERY:-100}
EVAL_SIZE=${EVAL_SIZE:-24}
KINDS=${KINDS:-"hspec dspark dflash dflash-kvreuse peagle hspec-lasttoken-only hspec-kvreuse-only mamba-only attention-only hspec-nomarkov"}
FEATURES=${FEATURES:-runs/features/part1,runs/features/part2,runs/features/part3,runs/features/part4,runs/features/part5,runs/features/part6,runs/features/part7}
OUT=results/comparison
mkdir -p "$OUT"

# 1. One recipe for all: 0.1 CE + 0.9 TV, gamma 4, AdamW 6e-4, 1% warmup + half-cosine, Vp = 8192.
#    LANES trainings run side by side, one torch thread each (2 lanes use a 2-core machine best).
LANES=${LANES:-2}
runs=()
drafters=()
for kind in $KINDS; do
  runs+=("runs/compare/$kind")
  drafters+=("$kind=runs/compare/$kind/drafter")
done
train_lane() {  # train_lane INDEX: every LANES-th kind from INDEX
  local i=0
  for kind in $KINDS; do
    if (( i % LANES == $1 )); then
      mkdir -p "runs/compare/$kind"
      OMP_NUM_THREADS=1 $HSPEC train --drafter "$kind" --features "$FEATURES" --out "runs/compare/$kind" \
        --steps "$STEPS" --val-every "$VAL_EVERY" --draft-vocab 8192 > "runs/compare/$kind/train.log" 2>&1
    fi
    i=$((i + 1))
  done
}
pids=()
for ((lane = 0; lane < LANES; lane++)); do
  train_lane "$lane" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
$HSPEC train-report "${runs[@]}" --out "$OUT/training.md" --title "All kinds, one recipe, SmolLM2-135M-Instruct"

# 2. (Skipped when its JSON exists: delete it to rerun.) Every kind against plain decoding, greedy, K = 7, interleaved item by item (tau, speedup, CIs,
#    acceptance per position, the ablation plot).
list=$(IFS=,; echo "ngram,${drafters[*]}")
[ -f "$OUT/eval_spec_bench_k7_greedy.json" ] || $HSPEC eval --drafters "$list" --tasks spec_bench --size "$EVAL_SIZE" --k 7 --max-new-tokens 128 --out "$OUT" \
  --name eval_spec_bench_k7_greedy

# 3. Draft-length sensitivity of H-Spec and the baselines (paper Table 4).
[ -f "$OUT/eval_spec_bench_k_sweep_greedy.json" ] || $HSPEC eval --drafters "hspec=runs/compare/hspec/drafter,dspark=runs/compare/dspark/drafter,dflash=runs/compare/dflash/drafter" \
  --tasks spec_bench --size "$EVAL_SIZE" --k 3,5,7 --max-new-tokens 128 --out "$OUT" --name eval_spec_bench_k_sweep_greedy
