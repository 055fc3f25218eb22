#!/usr/bin/env bash
# Continue an H-Spec drafter for the embedded default target (SmolLM2-135M-Instruct) on one CUDA GPU,
# within a fixed time: more target responses first, then the unified recipe on old and new responses
# with features computed online (no feature cache), then a bf16 export.
#
# Usage: scripts/train_hspec_smollm2_gpu.sh WORK_DIR [INIT_DRAFTER]
#   WORK_DIR      where corpora, the run, logs and the exported drafter go (resumable: rerun to continue)
#   INIT_DRAFTER  the drafter to continue (default: the shipped one)
# Environment (defaults in brackets):
#   TOTAL_SECONDS [540]  wall-clock budget of the whole script; training gets what generation leaves
#   GEN_SECONDS   [210]  generation budget: four processes side by side, each stopped after this long
#                        (a stopped part keeps its finished batches and resumes on a rerun)
#   PROMPTS       [train_prompts.jsonl]  the default training prompts (shipped in hspec/data, or a path)
#   TARGETED      [runs/data/prompts_targeted2.jsonl]  prompts nearer Spec-Bench's tasks, made with
#                 scripts/build_targeted_prompts.py OUT --gsm8k 2400 --summaries 600 --copies 800
#                 --exclude results/train_data/corpus_part*.jsonl
#   SEQS [8], ANCHORS [64], LR [3e-4]  the step: sequences x anchors per sequence, peak learning rate
#   GEN_BATCH [128]  prompts per generation batch;  DEVICE [cuda] (cpu runs the same steps, slowly)
#   PYTHON [python3]
# The corpus parts continue the prompt order of results/train_data (default prompts 3,232 onwards).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:?usage: $0 WORK_DIR [INIT_DRAFTER]}
INIT=${2:-src/hspec/assets/hspec-smollm2-135m-instruct}
PYTHON=${PYTHON:-python3}
TOTAL_SECONDS=${TOTAL_SECONDS:-540}
GEN_SECONDS=${GEN_SECONDS:-210}
PROMPTS=${PROMPTS:-train_prompts.jsonl}
TARGETED=${TARGETED:-runs/data/prompts_targeted2.jsonl}
SEQS=${SEQS:-8}
ANCHORS=${ANCHORS:-64}
LR=${LR:-3e-4}
GEN_BATCH=${GEN_BATCH:-128}
DEVICE=${DEVICE:-cuda}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
HSPEC="$PYTHON -m hspec.cli"
deadline=$(($(date +%s) + TOTAL_SECONDS))
mkdir -p "$WORK/data"

# 1. The target's greedy responses, four processes sharing the GPU (each is launch-bound, not GPU-bound).
gen() {  # gen NAME ARGS...
  local name=$1
  shift
  timeout "$GEN_SECONDS" $HSPEC data generate --device "$DEVICE" --max-new-tokens 192 --batch-size "$GEN_BATCH" "$@" \
    --out "$WORK/data/corpus_$name.jsonl" >"$WORK/gen_$name.log" 2>&1 || true
}
gen gpu1 --prompts "$PROMPTS" --skip-prompts 3232 --num-prompts 4000 &
gen gpu2 --prompts "$PROMPTS" --skip-prompts 7232 --num-prompts 4000 &
gen gpu3 --prompts "$PROMPTS" --skip-prompts 11232 &
gen gpu4 --prompts "$TARGETED" --max-prompt-tokens 1024 &
wait
new=""
for f in "$WORK"/data/corpus_gpu*.jsonl; do
  if [ -s "$f" ]; then new="$new,$f"; fi
  echo "[gpu] $f: $(wc -l <"$f") responses"
done

# 2. The recipe on every corpus, the committed ones first (so the held-out sequences are the CPU runs').
old=$(printf "%s\n" results/train_data/corpus_part{1..13}.jsonl | paste -sd,)  # the parts v7 saw, in order
train() {  # train RUN_DIR STEPS VAL_EVERY
  $HSPEC train --drafter hspec --corpus "$old$new" --device "$DEVICE" --init-from "$INIT" --lr "$LR" \
    --seqs-per-step "$SEQS" --anchors-per-seq "$ANCHORS" --out "$1" --steps "$2" --val-every "$3"
}
#    A 30-step probe measures the step time; the run then takes as many steps as the time left allows
#    (70 s kept for its validations, the save and the export).
if [ ! -d "$WORK/run/state" ]; then
  rm -rf "$WORK/probe"
  train "$WORK/probe" 30 1000000 >"$WORK/probe.log" 2>&1
  steps=$($PYTHON - "$WORK/probe/history.jsonl" "$deadline" <<'EOF'
import json, statistics, sys, time
seconds = [r["seconds"] for r in map(json.loads, open(sys.argv[1])) if r.get("event") == "step" and r["step"] >= 10]
left = int(sys.argv[2]) - time.time() - 70
print(max(50, int(0.92 * left / statistics.median(seconds))))
EOF
)
  echo "$steps" >"$WORK/steps"
fi
steps=$(cat "$WORK/steps")
echo "[gpu] training $steps steps of $SEQS x $ANCHORS blocks"
train "$WORK/run" "$steps" $(((steps + 1) / 2)) >"$WORK/train.log" 2>&1
$HSPEC export-drafter "$WORK/run/drafter" "$WORK/export" --dtype bf16
echo "[gpu] done: $WORK/export"
