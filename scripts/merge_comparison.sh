#!/usr/bin/env bash
# The last step of scripts/compare_long.sh, alone: every shard kept under $OUT/shards/ merged into one file per
# evaluation (`hspec lab merge`), the training report of every kept run redrawn where a history is newer than
# it, the paper's claims tested on the merged files (`hspec lab claims`, docs/claims.md) and one table of every
# drafter written (`hspec lab table`). Run it after copying in a shard folder evaluated on another machine:
#
#   cp -r /elsewhere/results/comparison_long/shards/<shard> results/comparison_long/shards/ && bash scripts/merge_comparison.sh
#
# then `python scripts/quote_result_tables.py` copies the new tables into results/comparison_long/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
HSPEC=${HSPEC:-.venv/bin/hspec}
OUT=${OUT:-results/comparison_long}
STEPS=${STEPS:-3000}
shopt -s nullglob
shards=("$OUT"/shards/*/)
if (( ${#shards[@]} == 0 )); then
  echo "[merge_comparison] no shard folder under $OUT/shards/: run scripts/compare_long.sh or copy one in" >&2
  exit 2
fi
$HSPEC lab merge "${shards[@]}" --out "$OUT"
every_run=("$OUT"/shards/*/runs/*/)
report=$OUT/training.md
if (( ${#every_run[@]} )) && { [ ! -f "$report" ] || [ -n "$(find "${every_run[@]/%/history.jsonl}" -newer "$report")" ]; }; then
  $HSPEC train-report "${every_run[@]%/}" --out "$report" --title "All kinds, one recipe, $STEPS steps, SmolLM2-135M-Instruct"
fi
$HSPEC lab claims "$OUT"
$HSPEC lab table "$OUT"
