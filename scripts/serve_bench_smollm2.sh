#!/usr/bin/env bash
# The serving benchmark of issue 6 on the embedded default target: plain decoding, H-Spec, DSpark and
# DFlash behind `hspec serve`, closed-loop HTTP clients at each concurrency level, one KV budget.
# The three drafters are the ones scripts/compare_smollm2.sh trained with one recipe and matched
# steps (run it first). Writes results/serving/serve_bench.{json,md} and the two plots (paper Fig. 6).
# CONCURRENCY, MAX_TOKENS and LEVEL_SECONDS override the defaults below.
set -euo pipefail
cd "$(dirname "$0")/.."
CONCURRENCY=${CONCURRENCY:-8,16,32,64,128}
MAX_TOKENS=${MAX_TOKENS:-32}
LEVEL_SECONDS=${LEVEL_SECONDS:-20}
.venv/bin/hspec bench serve --drafters none,hspec,dspark,dflash \
  --drafter-path hspec=runs/compare/hspec/drafter --drafter-path dspark=runs/compare/dspark/drafter \
  --drafter-path dflash=runs/compare/dflash/drafter --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" \
  --level-seconds "$LEVEL_SECONDS" --server-threads 1 --out results
