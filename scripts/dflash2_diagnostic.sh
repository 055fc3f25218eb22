#!/usr/bin/env bash
# Why does DFlash-2 train below DFlash in the long comparison (results/comparison_long/second_run/training.md)?
# docs/drafters.md (its dflash2 section): drafting by the backbone's U alone scored as the selector did, so the backbone
# is what lags. This trains DFlash-2 again with the long comparison's recipe, data and steps, once with the
# selector's loss kept off the backbone (`--drafter-option selector_trains_backbone=false`), then validates
# DFlash, DFlash-2 and the variant on the same held-out sequences (`hspec validate`, both validations).
# The variant's run is the one scripts/compare_long.sh trains as its kind dflash2-selector-detached (same
# command, same directory), whose shard (the plan's 7th) then only evaluates it.
# Run after scripts/compare_long.sh has trained (it reads its runs and features). Resumable: rerun after a
# kill and training continues from its last checkpoint. About 50 min on one core of a 2-core AVX-512 host.
# Writes $OUT/dflash2_diagnostic.{json,md} (OUT: results/comparison_long).
set -euo pipefail
cd "$(dirname "$0")/.."
HSPEC=${HSPEC:-.venv/bin/hspec}
RUNS=${RUNS:-runs/compare_long}
OUT=${OUT:-results/comparison_long}
STEPS=${STEPS:-3000}
VAL_EVERY=${VAL_EVERY:-500}
PARTS=${PARTS:-"1 2 3 4 5 6 7 8 9 10 11 12 13 14 15"}
features=""
for part in $PARTS; do
  features="$features,runs/features/part$part"
done
features=${features#,}
variant="$RUNS/dflash2-selector-detached"
mkdir -p "$variant"
$HSPEC train --drafter dflash2 --features "$features" --out "$variant" --steps "$STEPS" --val-every "$VAL_EVERY" \
  --draft-vocab 8192 --drafter-option selector_trains_backbone=false >> "$variant/train.log" 2>&1
echo "[dflash2_diagnostic] $(tail -n 1 "$variant/train.log")"
$HSPEC validate "$RUNS/dflash/drafter" "$RUNS/dflash2/drafter" "$variant/drafter" --features "$features" \
  --out "$OUT" --name dflash2_diagnostic
