#!/usr/bin/env bash
# The scaling curve of issue 54: the shipped drafter's recipe from scratch at several budgets of blocks, each
# run's schedule ending at its budget, measured on the held-out split and on Spec-Bench responses
# (`hspec lab scaling --help`; src/hspec/lab/scaling.py). Writes results/scaling_curve/scaling_<KIND>.{json,md,png}.
# Every step resumes: rerun the script after a kill (or a machine lost); finished runs are neither trained nor
# measured again. A run paused with SIGSTOP and continued with SIGCONT goes on unharmed (only its logged step
# time includes the pause).
#
# Settings (environment; defaults in brackets):
#   KIND [hspec]   drafter kind;  BUDGETS [6400,12800,...,204800: doublings]  blocks of each run (multiples of 64)
#   RUNS [runs/scaling]  run directories, kept across sessions (outside the repository is best)
#   FEATURES_DIR [runs/features]  the feature caches of parts 1-7 (made or finished here, as
#                                 scripts/train_hspec_smollm2.sh makes them; a finished cache is only checked)
#   REFERENCE [shipped]  a drafter measured beside the curve ('none' for none)
#   THREADS [1]  torch threads;  OUT [results/scaling_curve];  DRY_RUN [unset]: print the commands only
# What the committed files were made with: scripts/scaling_curve.sh under `nice -n 19` (one thread), with
# RUNS=/work/scaling_runs FEATURES_DIR=/work/scaling_runs/features; DFlash with KIND=dflash BUDGETS=6400,12800,25600
# REFERENCE=none (no shipped DFlash drafter). The report keeps the finished runs only.
set -euo pipefail
cd "$(dirname "$0")/.."
KIND=${KIND:-hspec}
BUDGETS=${BUDGETS:-6400,12800,25600,51200,102400,204800}
RUNS=${RUNS:-runs/scaling}
FEATURES_DIR=${FEATURES_DIR:-runs/features}
REFERENCE=${REFERENCE:-shipped}
THREADS=${THREADS:-1}
OUT=${OUT:-results/scaling_curve}
HSPEC=${HSPEC:-.venv/bin/hspec}
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS PYTHONUNBUFFERED=1
run() { echo "+ $*"; if [ -z "${DRY_RUN:-}" ]; then "$@"; fi; }

# 1. Target features of the training responses: parts 1-7 of results/train_data, the data of the shipped
#    drafter's first run (hspec_v3); their first 24 held-out ids are also every later run's.
parts=""
for i in 1 2 3 4 5 6 7; do
  run "$HSPEC" data features --corpus "results/train_data/corpus_part$i.jsonl" --out "$FEATURES_DIR/part$i"
  parts="$parts$FEATURES_DIR/part$i,"
done
# 2. The runs, their measurements (the Spec-Bench responses' features are made once, under RUNS) and the report.
mkdir -p "$RUNS"
run "$HSPEC" lab scaling --kind "$KIND" --budgets "$BUDGETS" --features "${parts%,}" --runs-dir "$RUNS" \
  --reference "$REFERENCE" --out "$OUT"
