#!/usr/bin/env bash
# The long comparison's plan (results/comparison_long/README.md; docs/claims.md#shards): its seven shards in order,
# each one run of scripts/compare_long.sh, and the DFlash-2 diagnostic (scripts/dflash2_diagnostic.sh) after
# the shard that trains DFlash-2. With the defaults this reproduces results/comparison_long/.
#
#   bash scripts/compare_long_shards.sh          all seven shards (~13.5 h of a 2-core CPU)
#   bash scripts/compare_long_shards.sh 3 4      shards 3 and 4 only
#
# A shard's trained drafters stay on the host that trained them (RUNS), so on a new host name only the
# shards still to do: a shard run again without its drafters trains them again. Resumable: rerun the same
# command after a kill; a finished shard whose drafters are present reruns in about a minute (its checks and
# the merge). Every setting of compare_long.sh (PARTS, LANES, RUNS, OUT, HSPEC, ...) passes through.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARDS=(
  "ngram hspec dflash"
  "dflash-kvreuse dspark attention-only"
  "hspec-nomarkov dfly mamba-only"
  "dflash2 specblock"
  "hspec-kvreuse-only dels"
  "peagle hspec-lasttoken-only"
  "dflash2-selector-detached"
)
RUNS=${RUNS:-runs/compare_long}
export RUNS
chosen=("$@")
if (( ${#chosen[@]} == 0 )); then chosen=($(seq 1 ${#SHARDS[@]})); fi
for n in "${chosen[@]}"; do
  if ! [[ "$n" =~ ^[0-9]+$ ]] || (( n < 1 || n > ${#SHARDS[@]} )); then
    echo "[compare_long_shards] no shard '$n' in the plan: the shards are 1 to ${#SHARDS[@]}" >&2
    exit 2
  fi
done
for n in "${chosen[@]}"; do
  kinds=${SHARDS[$((n - 1))]}
  echo "[compare_long_shards] $(date -u +%FT%TZ) shard $n: $kinds"
  KINDS="$kinds" bash scripts/compare_long.sh
  if [[ " $kinds " == *" dflash2 "* ]]; then
    if [ -d "$RUNS/dflash/drafter" ]; then
      echo "[compare_long_shards] $(date -u +%FT%TZ) the DFlash-2 diagnostic"
      OMP_NUM_THREADS=${LANES:-2} bash scripts/dflash2_diagnostic.sh
    else
      echo "[compare_long_shards] the DFlash-2 diagnostic compares with shard 1's DFlash, which is not on this" \
           "host ($RUNS/dflash/drafter); skipped: run shard 1 here first, then this shard again" >&2
    fi
  fi
done
echo "[compare_long_shards] $(date -u +%FT%TZ) done: shards ${chosen[*]}"
