#!/usr/bin/env bash
# Speculation by batch size on the embedded default target (`hspec serve --spec-max-batch`): plain
# decoding beside the shipped H-Spec drafter speculating always, and speculating only while at most 1
# or 2 sequences run, closed-loop HTTP clients at small and large concurrency, one KV budget.
# Writes results/serving/serve_spec_max_batch.{json,md} and its two plots (docs/fast-path.md).
# CONCURRENCY, LIMITS, MAX_TOKENS, LEVEL_SECONDS and DTYPE override the defaults below.
set -euo pipefail
cd "$(dirname "$0")/.."
CONCURRENCY=${CONCURRENCY:-1,2,4,16}
LIMITS=${LIMITS:-none,1,2}
MAX_TOKENS=${MAX_TOKENS:-32}
LEVEL_SECONDS=${LEVEL_SECONDS:-20}
DTYPE=${DTYPE:-auto}
.venv/bin/hspec bench serve --dtype "$DTYPE" --drafters none,hspec --spec-max-batch "$LIMITS" \
  --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" --level-seconds "$LEVEL_SECONDS" --server-threads 1 \
  --name serve_spec_max_batch --out results
