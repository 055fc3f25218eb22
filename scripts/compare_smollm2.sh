#!/usr/bin/env bash
# The comparison of every drafter kind and ablation on the embedded default target (SmolLM2-135M-Instruct):
# each trained with the same recipe, data, draft vocabulary and steps, then evaluated interleaved with
# plain decoding. Resumable at every step: rerun the script after a kill. Results go to results/comparison/.
#
# Needs the feature caches of scripts/train_hspec_smollm2.sh (steps 1-2). The defaults are the settings
# of the committed results/comparison/ (300 steps per kind on features part1-5, 18 Spec-Bench items for
# K = 7, 12 for the K sweep): about an hour of training in two lanes plus the evaluations on 2 cores.
# STEPS, KINDS, LANES, VAL_EVERY, FEATURES, EVAL_SIZE and SWEEP_SIZE override; the bigger run the recipe
# was sized for (about 4 CPU-hours of training) is
#   STEPS=700 EVAL_SIZE=24 SWEEP_SIZE=24 \
#   FEATURES=$(echo runs/features/part{1..7} | tr ' ' ,) scripts/compare_smollm2.sh
# The later kinds (dflash2, dfly, dels; not in the committed run) join with
#   KINDS="hspec dspark dflash dflash-kvreuse peagle dflash2 dfly dels ..." (dels trains last, over dflash).
# On a GPU, run it unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
HSPEC=.venv/bin/hspec
STEPS=${STEPS:-300}
VAL_EVERY=${VAL_EVERY:-100}
EVAL_SIZE=${EVAL_SIZE:-18}
SWEEP_SIZE=${SWEEP_SIZE:-12}
KINDS=${KINDS:-"hspec dspark dflash dflash-kvreuse peagle hspec-lasttoken-only hspec-kvreuse-only mamba-only attention-only hspec-nomarkov"}
FEATURES=${FEATURES:-runs/features/part1,runs/features/part2,runs/features/part3,runs/features/part4,runs/features/part5}
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
    if [ "$kind" != dels ] && (( i % LANES == $1 )); then
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
# DeLS-Spec trains its local head over the trained DFlash drafter, which stays frozen (same steps and data).
if [[ " $KINDS " == *" dels "* ]]; then
  mkdir -p runs/compare/dels
  OMP_NUM_THREADS=2 $HSPEC train --drafter dels --init-from runs/compare/dflash/drafter --features "$FEATURES" \
    --out runs/compare/dels --steps "$STEPS" --val-every "$VAL_EVERY" > runs/compare/dels/train.log 2>&1
fi
$HSPEC train-report "${runs[@]}" --out "$OUT/training.md" --title "All kinds, one recipe, SmolLM2-135M-Instruct"

# 2. (Kept where its JSON was made with the same settings and drafters: --keep-current.) Every kind against plain decoding, greedy, K = 7, interleaved item by item (tau, speedup, CIs,
#    acceptance per position, the ablation plot).
list=$(IFS=,; echo "ngram,${drafters[*]}")
$HSPEC eval --keep-current --drafters "$list" --tasks spec_bench --size "$EVAL_SIZE" --k 7 --max-new-tokens 128 --out "$OUT" \
  --name eval_spec_bench_k7_greedy

# 3. Draft-length sensitivity of H-Spec and the baselines (paper Table 4).
$HSPEC eval --keep-current --drafters "hspec=runs/compare/hspec/drafter,dspark=runs/compare/dspark/drafter,dflash=runs/compare/dflash/drafter" \
  --tasks spec_bench --size "$SWEEP_SIZE" --k 3,5,7 --max-new-tokens 128 --out "$OUT" --name eval_spec_bench_k_sweep_greedy
