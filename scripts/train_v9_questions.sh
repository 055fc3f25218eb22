#!/usr/bin/env bash
# v9 (not shipped; results/v9_questions/): the v7 drafter continued on this CPU for 1,200 steps on the
# thirteen parts v7 saw, the GPU responses (results/train_data/gpu/) and 589 new responses: 403 short
# factual questions (part 14) and passages to summarize or answer about (part 15). Then the
# report, the held-out validation beside v7 and v8, and the 18 dev items against v7.
#
# Usage: scripts/train_v9_questions.sh [STAGE ...]   stages: data features train report validate dev
#   (default: all, in that order). Every stage resumes or redoes its work: rerun after a kill.
# Environment (defaults reproduce the committed run):
#   STEPS [1200]   training steps;  INIT [runs/train/hspec_v7/drafter]: v7 in fp32, made by
#                  scripts/train_hspec_smollm2.sh (src/hspec/assets/hspec-smollm2-135m-instruct is its
#                  bf16 export: close, not identical)
#   V8 [runs/train/hspec_v8_gpu/drafter]  v8, made on a GPU by scripts/train_hspec_smollm2_gpu.sh; validated
#                  beside v7 and v9 when present (the committed file has it)
#   RUNS [runs]    corpora, feature caches and runs;  OUT [results/v9_questions]  the results folder
#   REGENERATE     set to make parts 14-15 anew instead of copying the committed corpora
#   MAX_SEQUENCES  only for a quick check: cache at most this many sequences per part
#   DRY_RUN        set to print the commands instead of running them
set -euo pipefail
cd "$(dirname "$0")/.."
HSPEC=${HSPEC:-.venv/bin/hspec}
PYTHON=${PYTHON:-.venv/bin/python}
STEPS=${STEPS:-1200}
INIT=${INIT:-runs/train/hspec_v7/drafter}
V8=${V8:-runs/train/hspec_v8_gpu/drafter}
RUNS=${RUNS:-runs}
OUT=${OUT:-results/v9_questions}
STAGES=${*:-data features train report validate dev}
OLD_PARTS="part1 part2 part3 part4 part5 part6 part7 part8 part9 part10 part11 part12 part13"
GPU_PARTS="gpu1 gpu2 gpu3 gpu4"
NEW_PARTS="part14 part15"
RUN=$RUNS/train/hspec_v9

run() {  # print the command (quoted as bash would read it back), then run it unless DRY_RUN
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [ -z "${DRY_RUN:-}" ]; then "$@"; fi
}
copy_missing() {  # copy_missing DEST FILE...: copy each FILE that DEST does not hold yet
  local dest=$1
  shift
  for f in "$@"; do
    if [ ! -e "$dest/$(basename "$f")" ]; then run cp "$f" "$dest/"; fi
  done
}
wants() { [[ " $STAGES " == *" $1 "* ]]; }
features_of() { for part in "$@"; do printf '%s/features/%s,' "$RUNS" "$part"; done | sed 's/,$//'; }

# 1. Corpora: the committed ones are copied in (parts 1-15 and gpu1-4). With REGENERATE, parts 14-15 are
#    made anew: prompts from scripts/build_targeted_prompts.py, then the target's greedy responses.
if wants data; then
  run mkdir -p "$RUNS/data"
  if [ -z "${REGENERATE:-}" ]; then
    copy_missing "$RUNS/data" results/train_data/corpus_part*.jsonl results/train_data/corpus_part*.settings.json
  else
    copy_missing "$RUNS/data" results/train_data/corpus_part{1..13}.jsonl results/train_data/corpus_part{1..13}.settings.json
    exclude=(results/train_data/corpus_part{1..13}.jsonl)
    run "$PYTHON" scripts/build_targeted_prompts.py runs/data/prompts_questions.jsonl --gsm8k 0 --summaries 0 \
      --no-long --questions 403 --exclude "${exclude[@]}" results/train_data/gpu/corpus_gpu*.jsonl
    run "$PYTHON" scripts/build_targeted_prompts.py runs/data/prompts_passages.jsonl --gsm8k 2400 --summaries 600 \
      --copies 800 --exclude "${exclude[@]}" --only summarize copy_passage_qa \
      --drop-made "${exclude[@]}" results/train_data/gpu/corpus_gpu*.jsonl
    # The prompt paths are as the committed settings files record them (runs/data/...).
    run env OMP_NUM_THREADS=2 "$HSPEC" data generate --prompts runs/data/prompts_questions.jsonl \
      --max-prompt-tokens 384 --max-new-tokens 192 --batch-size 32 --out "$RUNS/data/corpus_part14.jsonl"
    run env OMP_NUM_THREADS=2 "$HSPEC" data generate --prompts runs/data/prompts_passages.jsonl \
      --max-prompt-tokens 1024 --max-new-tokens 192 --batch-size 16 --out "$RUNS/data/corpus_part15.jsonl"
  fi
  copy_missing "$RUNS/data" results/train_data/gpu/corpus_gpu*.jsonl results/train_data/gpu/corpus_gpu*.settings.json
fi

# 2. Target features per part, cached once (a rerun skips the sequences already cached).
if wants features; then
  for part in $OLD_PARTS $GPU_PARTS $NEW_PARTS; do
    run env OMP_NUM_THREADS=2 "$HSPEC" data features --corpus "$RUNS/data/corpus_$part.jsonl" \
      --out "$RUNS/features/$part" ${MAX_SEQUENCES:+--max-sequences "$MAX_SEQUENCES"}
  done
fi

# 3. The recipe from v7 (0.1 CE + 0.9 TV, gamma 4), its schedule started over at half the first runs'
#    peak learning rate, validating at steps 600 and 1,200. The feature order fixes the held-out split.
if wants train; then
  run env OMP_NUM_THREADS=2 "$HSPEC" train --drafter hspec --features "$(features_of $OLD_PARTS $GPU_PARTS $NEW_PARTS)" \
    --init-from "$INIT" --lr 3e-4 --steps "$STEPS" --val-every 600 --precision fp32 --device cpu --out "$RUN"
fi

# 4. The report reads the run's history, kept in the results folder.
if wants report; then
  run mkdir -p "$OUT/hspec_v9"
  run cp "$RUN/history.jsonl" "$OUT/hspec_v9/history.jsonl"
  run "$HSPEC" train-report "$OUT/hspec_v9" --out "$OUT/train_hspec_v9.md" \
    --title "H-Spec v9 (not shipped): v7 continued on CPU with short factual questions, passages and the GPU responses"
fi

# 5. Held-out validation on the 24 sequences v7's own validation used (the thirteen parts' split).
if wants validate; then
  drafters=(src/hspec/assets/hspec-smollm2-135m-instruct)
  if [ -e "$V8/config.json" ] || [ -n "${DRY_RUN:-}" ]; then
    drafters+=("$V8")
  else
    echo "[v9] no v8 drafter at $V8 (scripts/train_hspec_smollm2_gpu.sh makes it on a GPU): validating v7 and v9 only"
  fi
  run env OMP_NUM_THREADS=2 "$HSPEC" validate "${drafters[@]}" "$RUN/drafter" --features "$(features_of $OLD_PARTS)" \
    --out "$OUT" --name validation_v7_v8_v9
fi

# 6. The 18 dev items, decoded and interleaved with plain decoding (about 20 min on 2 cores).
if wants dev; then
  run env OMP_NUM_THREADS=2 "$PYTHON" scripts/tune_on_dev_items.py hspec "hspec=$RUN/drafter" hspec+ngram:0.4 \
    "hspec+ngram:0.4=$RUN/drafter" --out "$OUT/dev_items_v9.md"
fi
