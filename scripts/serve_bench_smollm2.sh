#!/usr/bin/env bash
# The serving benchmark of issue 6 on the embedded default target: plain decoding, H-Spec, DSpark and
# DFlash behind `hspec serve`, closed-loop HTTP clients at each concurrency level, one KV budget.
# The three drafters are the ones scripts/compare_long.sh trained with one recipe for 3,000 steps each
# (run it first; RUNS points elsewhere). Every server runs the target in DTYPE (auto: bf16 on a CPU with
# native bf16, else fp32). Writes results/serving/serve_bench.{json,md} and the two plots (paper Fig. 6).
# CONCURRENCY, MAX_TOKENS, LEVEL_SECONDS, DTYPE and RUNS override the defaults below.
set -euo pipefail
cd "$(dirname "$0")/.."
CONCURRENCY=${CONCURRENCY:-8,16,32,64,128}
MAX_TOKENS=${MAX_TOKENS:-32}
LEVEL_SECONDS=${LEVEL_SECONDS:-20}
DTYPE=${DTYPE:-auto}
RUNS=${RUNS:-runs/compare_long}
.venv/bin/hspec bench serve --dtype "$DTYPE" --drafters none,hspec,dspark,dflash \
  --drafter-path hspec="$RUNS/hspec/drafter" --drafter-path dspark="$RUNS/dspark/drafter" \
  --drafter-path dflash="$RUNS/dflash/drafter" --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" \
  --level-seconds "$LEVEL_SECONDS" --server-threads 1 --out results
