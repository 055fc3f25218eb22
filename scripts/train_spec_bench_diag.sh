#!/usr/bin/env bash
# The in-domain diagnostic (never shipped; results/spec_bench_split_diag/): drafters v10-diag, v10-half-diag
# and v11-diag, continued from the shipped v7 on the target's responses to the 438 Spec-Bench items outside
# every subset we evaluate or tune on, mixed with part 2; then their reports, their validation on 24
# held-out Spec-Bench items beside v7, and the 18 dev items (v10-diag against v7).
#
# Usage: scripts/train_spec_bench_diag.sh [STAGE ...]   stages: data features train report validate dev
#   (default: all, in that order). Every stage resumes or redoes its work: rerun after a kill.
# Environment (defaults reproduce the committed runs):
#   STEPS [600]  steps of v10-diag and v10-half-diag;  MORE_STEPS [2000]  v11-diag's steps after v10-diag
#   INIT [src/hspec/assets/hspec-smollm2-135m-instruct]  the drafter they start from (v7 as shipped)
#   RUNS [runs]  corpora, feature caches and runs;  OUT [results/spec_bench_split_diag]  the results folder
#   REGENERATE   set to generate the split's responses anew (14.7 min on 2 cores) instead of copying the
#                committed corpus
#   MAX_SEQUENCES  only for a quick check: cache at most this many sequences per corpus
#   DRY_RUN      set to print the commands instead of running them
set -euo pipefail
cd "$(dirname "$0")/.."
HSPEC=${HSPEC:-.venv/bin/hspec}
PYTHON=${PYTHON:-.venv/bin/python}
STEPS=${STEPS:-600}
MORE_STEPS=${MORE_STEPS:-2000}
INIT=${INIT:-src/hspec/assets/hspec-smollm2-135m-instruct}
RUNS=${RUNS:-runs}
OUT=${OUT:-results/spec_bench_split_diag}
STAGES=${*:-data features train report validate dev}
SPLIT=$RUNS/spec_bench_split
FULL="$RUNS/features/spec_bench_split,$RUNS/features/part2"  # the feature order fixes the held-out split
HALF="$RUNS/features/spec_bench_half,$RUNS/features/part2"

run() {  # print the command (quoted as bash would read it back), then run it unless DRY_RUN
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [ -z "${DRY_RUN:-}" ]; then "$@"; fi
}
wants() { [[ " $STAGES " == *" $1 "* ]]; }

# 1. Corpora. The split: Spec-Bench first turns outside `hspec eval --size 24` and the dev items (438).
#    Its greedy responses are committed (copied in unless REGENERATE); the prompts path is the one the
#    committed settings file records. Half the split: every other line, from the first (219 items).
if wants data; then
  run mkdir -p runs/data "$RUNS/data" "$SPLIT"
  run "$PYTHON" scripts/build_spec_bench_diagnostic_split.py runs/data/prompts_spec_bench_split.jsonl
  if [ -z "${REGENERATE:-}" ] && [ ! -e "$SPLIT/corpus.jsonl" ]; then
    run cp results/spec_bench_split_diag/corpus_spec_bench_split.jsonl "$SPLIT/corpus.jsonl"
    run cp results/spec_bench_split_diag/corpus_spec_bench_split.settings.json "$SPLIT/corpus.settings.json"
  fi
  run env OMP_NUM_THREADS=2 "$HSPEC" data generate --prompts runs/data/prompts_spec_bench_split.jsonl \
    --max-prompt-tokens 2048 --max-new-tokens 128 --batch-size 8 --out "$SPLIT/corpus.jsonl"
  if [ -n "${DRY_RUN:-}" ]; then
    echo "+ sed -n '1~2p' $SPLIT/corpus.jsonl > $SPLIT/corpus_half.jsonl"
  else
    sed -n '1~2p' "$SPLIT/corpus.jsonl" >"$SPLIT/corpus_half.jsonl"
  fi
  if [ ! -e "$RUNS/data/corpus_part2.jsonl" ]; then
    run cp results/train_data/corpus_part2.jsonl results/train_data/corpus_part2.settings.json "$RUNS/data/"
  fi
fi

# 2. Target features, cached once (a rerun skips the sequences already cached).
if wants features; then
  for pair in "$SPLIT/corpus.jsonl:spec_bench_split" "$SPLIT/corpus_half.jsonl:spec_bench_half" \
    "$RUNS/data/corpus_part2.jsonl:part2"; do
    run env OMP_NUM_THREADS=2 "$HSPEC" data features --corpus "${pair%%:*}" --out "$RUNS/features/${pair##*:}" \
      ${MAX_SEQUENCES:+--max-sequences "$MAX_SEQUENCES"}
  done
fi

# 3. The recipe (0.1 CE + 0.9 TV, gamma 4) from v7, lr 3e-4: v10-diag on the whole split, v10-half-diag on
#    half of it (both validating every 100 steps, the default), then v11-diag from v10-diag.
if wants train; then
  train() {  # train NAME FEATURES INIT STEPS VAL_EVERY
    run env OMP_NUM_THREADS=2 "$HSPEC" train --drafter hspec --features "$2" --init-from "$3" --lr 3e-4 \
      --steps "$4" --val-every "$5" --precision fp32 --device cpu --out "$RUNS/train/$1"
  }
  train hspec_v10_diag "$FULL" "$INIT" "$STEPS" 100
  train hspec_v11_diag "$FULL" "$RUNS/train/hspec_v10_diag/drafter" "$MORE_STEPS" 500
  train hspec_v10_half_diag "$HALF" "$INIT" "$STEPS" 100
fi

# 4. The reports read each run's history, kept in the results folder.
if wants report; then
  report() {  # report NAME TITLE
    run mkdir -p "$OUT/$1"
    run cp "$RUNS/train/$1/history.jsonl" "$OUT/$1/history.jsonl"
    run "$HSPEC" train-report "$OUT/$1" --out "$OUT/train_$1.md" --title "$2"
  }
  report hspec_v10_diag "H-Spec v10-diag (diagnostic, not shipped): v7 continued on 438 Spec-Bench items disjoint from every measured subset, plus part 2"
  report hspec_v11_diag "H-Spec v11-diag (diagnostic, not shipped): v10-diag continued 2,000 steps on the same in-domain mix"
  report hspec_v10_half_diag "H-Spec v10-half-diag (diagnostic, not shipped): v7 continued 600 steps on half the in-domain items (219) plus part 2"
fi

# 5. Validation on the whole mix's held-out split: 24 Spec-Bench items none of these drafters trained on.
if wants validate; then
  run env OMP_NUM_THREADS=2 "$HSPEC" validate src/hspec/assets/hspec-smollm2-135m-instruct \
    "$RUNS/train/hspec_v10_half_diag/drafter" "$RUNS/train/hspec_v10_diag/drafter" "$RUNS/train/hspec_v11_diag/drafter" \
    --features "$FULL" --out "$OUT" --name validation_v7_half_v10_v11
fi

# 6. The 18 dev items, decoded and interleaved with plain decoding (about 20 min on 2 cores).
if wants dev; then
  run env OMP_NUM_THREADS=2 "$PYTHON" scripts/tune_on_dev_items.py hspec "hspec=$RUNS/train/hspec_v10_diag/drafter" \
    hspec+ngram:0.4 "hspec+ngram:0.4=$RUNS/train/hspec_v10_diag/drafter" --out "$OUT/dev_items_v10diag.md"
fi
