#!/usr/bin/env bash
# The long comparison (issue 18): every drafter kind and ablation trained with one recipe for 3,000 steps
# on the whole committed corpus (results/train_data/corpus_part1-15, 5,173 responses of the target), then
# evaluated interleaved with plain decoding. Results go to results/comparison_long/.
#
# Shards. The trained drafters (tens of MB each) do not travel between machines, and a 2-core CPU needs
# about 13 hours for all of them, more than one machine has been kept. So the comparison runs in shards:
# `KINDS="hspec dflash" bash scripts/compare_long.sh` trains those kinds and at once evaluates them into
# $OUT/shards/<kinds joined by +>/ (SHARD names it otherwise); only those small JSONs and the runs'
# histories kept beside them have to be kept.
# Then every shard present is merged into $OUT (`hspec lab merge`: each drafter's speedup over its own
# shard's plain decoding, drafters paired only where their shards' plain outputs agree) and the claims
# are tested on the merged files. A shard needs ~20 min of features, its kinds' training (~50-120 min a
# kind on one core; LANES kinds side by side) and its evaluations (~25 min a kind on 2 threads). With
# KINDS unset every kind trains and evaluates in one shard, "all". `ngram` (model-free) is a kind that
# trains nothing. DeLS-Spec trains over a DFlash of its own shard: where `dflash` is not in KINDS (it was
# evaluated in another shard), a DFlash is trained as its base only and kept as the shard's `dels-base` run.
#
# Resumable at every step: rerun the same command after a kill and it continues where it stopped
# (feature files, training checkpoints every 10 minutes, finished evaluation items are kept). On a CUDA
# GPU run it unchanged (training then takes minutes per kind). The defaults are the settings of the
# committed results/comparison_long/; LANES only sets how many processes run side by side (one torch
# thread each), which changes no result.
set -euo pipefail
cd "$(dirname "$0")/.."
HSPEC=${HSPEC:-.venv/bin/hspec}
STEPS=${STEPS:-3000}
VAL_EVERY=${VAL_EVERY:-500}
LANES=${LANES:-2}
EVAL_SIZE=${EVAL_SIZE:-24}
TASK_SIZE=${TASK_SIZE:-16}
DTYPE=${DTYPE:-bfloat16}  # the evaluations' runtime: one for every shard, so shards made on other CPUs merge (bf16 is
                          # emulated, slower, where a CPU lacks AVX512-BF16; the training picks its own precision)
PARTS=${PARTS:-"1 2 3 4 5 6 7 8 9 10 11 12 13 14 15"}
# Order matters only for what finishes first: the trained kinds take lanes in turn (the INDEX-th trained
# kind, DeLS-Spec left out, in lane INDEX % LANES); DeLS-Spec trains last, over DFlash, with every thread.
# A shard's KINDS in the same way: "dflash-kvreuse dspark attention-only" puts DSpark alone in lane 1.
# The last, dflash2-selector-detached, is hspec's variant rather than a paper's kind: DFlash-2 trained with the
# selector's loss kept off the backbone (`--drafter-option selector_trains_backbone=false`), the one change that
# scripts/dflash2_diagnostic.sh found to lift it above DFlash (docs/drafters.md); evaluated here it tests the
# DFlash-2 claim again with that change.
ALL_KINDS="ngram hspec dflash peagle dspark dflash-kvreuse hspec-lasttoken-only hspec-kvreuse-only mamba-only attention-only hspec-nomarkov dflash2 dfly dels specblock dflash2-selector-detached"
if [ -z "${KINDS:-}" ]; then
  KINDS=$ALL_KINDS
  SHARD=${SHARD:-all}
fi
SHARD=${SHARD:-$(echo $KINDS | tr ' ' '+')}
for kind in $KINDS; do
  if [[ " $ALL_KINDS " != *" $kind "* ]]; then
    echo "[compare_long] unknown kind '$kind' in KINDS; the comparison's kinds are: $ALL_KINDS" >&2
    exit 2
  fi
done
BASE=""  # a kind trained only for another to build on, not evaluated here
if [[ " $KINDS " == *" dels "* && " $KINDS " != *" dflash "* ]]; then BASE=dflash; fi
OUT=${OUT:-results/comparison_long}
SHARD_OUT=$OUT/shards/$SHARD
RUNS=${RUNS:-runs/compare_long}
mkdir -p "$OUT" "$SHARD_OUT" "$RUNS" runs/features
# One run at a time: a second one started while this one lives (a resumed session that finds the first still
# going) would train the same run directories. The lock goes with this process.
exec 9> "$RUNS/.lock"
if ! flock -n 9; then
  echo "[compare_long] another run holds $RUNS/.lock; not starting a second one" >&2
  exit 1
fi

# 1. Target features of every committed corpus part (5 tapped layers' hidden states, their K/V, the final
#    hidden state and the teacher's summary), computed once in fp32 and cached; a part already complete
#    is only checked. Parts run in LANES processes of one thread each (a 2-thread process slows down
#    several-fold whenever anything else takes a core).
lane_share() {  # lane_share INDEX ITEM...: every LANES-th ITEM from the INDEX-th (0-based), one a line
  local lane=$1 i=0
  shift
  for item in "$@"; do
    if (( i % LANES == lane )); then echo "$item"; fi
    i=$((i + 1))
  done
}
run_lanes() {  # run_lanes FUNCTION: FUNCTION 0 .. FUNCTION LANES-1 side by side; fails when one of them fails
  local pids=() lane pid
  for ((lane = 0; lane < LANES; lane++)); do
    "$1" "$lane" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
}
features_lane() {  # features_lane INDEX: this lane's parts
  for part in $(lane_share "$1" $PARTS); do
    OMP_NUM_THREADS=1 $HSPEC data features --corpus "results/train_data/corpus_part$part.jsonl" \
      --out "runs/features/part$part"
  done
}
run_lanes features_lane
features=""
for part in $PARTS; do
  features="$features,runs/features/part$part"
done
features=${features#,}

# 2. One recipe for all: 0.1 CE + 0.9 TV, gamma 4, AdamW 6e-4, 1% warmup + half-cosine, Vp = 8192,
#    4 sequences x 16 anchors a step, --precision auto (bf16 autocast where the CPU has native bf16).
kind_of() {  # kind_of KIND: the drafter kind KIND trains (a variant's is another's; hspec eval then labels it
            # "<kind>@<variant>", after its run directory)
  case $1 in
    dflash2-selector-detached) echo dflash2 ;;
    *) echo "$1" ;;
  esac
}
drafter_args() {  # drafter_args KIND: the train arguments that choose KIND's drafter (a variant: its kind and option)
  case $1 in
    dflash2-selector-detached) echo "--drafter dflash2 --drafter-option selector_trains_backbone=false" ;;
    *) echo "--drafter $1" ;;
  esac
}
train_kind() {  # train_kind KIND [extra train args...]
  local kind=$1
  shift
  mkdir -p "$RUNS/$kind"
  $HSPEC train $(drafter_args "$kind") --features "$features" --out "$RUNS/$kind" --steps "$STEPS" \
    --val-every "$VAL_EVERY" --draft-vocab 8192 "$@" >> "$RUNS/$kind/train.log" 2>&1
  echo "[compare_long] $kind: $(tail -n 1 "$RUNS/$kind/train.log")"
}
TRAINED=$(for kind in $BASE $KINDS; do if [ "$kind" != ngram ]; then echo "$kind"; fi; done)
train_lane() {  # train_lane INDEX: this lane's kinds, in KINDS order (dels waits for dflash below)
  for kind in $(lane_share "$1" $(echo "$TRAINED" | grep -vx dels)); do
    OMP_NUM_THREADS=1 train_kind "$kind"
  done
}
run_lanes train_lane
# DeLS-Spec trains its local head over the trained DFlash drafter, which stays frozen (same steps and data).
if [[ " $KINDS " == *" dels "* ]]; then
  OMP_NUM_THREADS=$LANES train_kind dels --init-from "$RUNS/dflash/drafter"
fi
drafters=()
for kind in $TRAINED; do
  if [ "$kind" != "$BASE" ]; then drafters+=("$(kind_of "$kind")=$RUNS/$kind/drafter"); fi
done
# Each run's history (its loss and validation log, ~100 KB) is kept in the shard beside its evaluations,
# so the training report of every shard can be redrawn after the runs themselves are gone. Reports are
# rewritten only when a history changed since (a rerun of a finished run writes nothing), so a resumed
# script leaves the tree clean for the evaluations' provenance.
kept=()
for kind in $TRAINED; do
  name=$kind
  if [ "$kind" = "$BASE" ]; then name=dels-base; fi  # the kind's own name belongs to its evaluated run
  mkdir -p "$SHARD_OUT/runs/$name"
  cmp -s "$RUNS/$kind/history.jsonl" "$SHARD_OUT/runs/$name/history.jsonl" \
    || cp "$RUNS/$kind/history.jsonl" "$SHARD_OUT/runs/$name/history.jsonl"
  kept+=("$SHARD_OUT/runs/$name")
done
report_if_newer() {  # report_if_newer REPORT TITLE RUN_DIR...: hspec train-report when a history is newer
  local report=$1 title=$2
  shift 2
  if (( $# )) && { [ ! -f "$report" ] || [ -n "$(find "${@/%//history.jsonl}" -newer "$report")" ]; }; then
    $HSPEC train-report "$@" --out "$report" --title "$title"
  fi
}
report_if_newer "$SHARD_OUT/training.md" "Shard $SHARD: one recipe, $STEPS steps, SmolLM2-135M-Instruct" "${kept[@]}"
if [[ " $KINDS " == *" ngram "* ]]; then drafters=(ngram "${drafters[@]}"); fi
list=$(IFS=,; echo "${drafters[*]}")

# 3. Evaluations, all interleaved item by item with plain decoding in the same process. Each is kept where
#    its JSON was made with the same settings and the same trained drafters (`--keep-current`: the report
#    records each checkpoint's digest), so a rerun after retraining evaluates the new drafters.
export OMP_NUM_THREADS=2
#    Paper Table 2 / Fig. 4 / Fig. 7: every kind and ablation, Spec-Bench subset, K = 7, greedy.
$HSPEC eval --keep-current --dtype "$DTYPE" --drafters "$list" --tasks spec_bench \
  --size "$EVAL_SIZE" --k 7 --max-new-tokens 128 --out "$SHARD_OUT" --name eval_spec_bench_k7_greedy
#    Paper Table 3: the same at temperature 1.0 (lossless rejection sampling; tau is the measure).
$HSPEC eval --keep-current --dtype "$DTYPE" --drafters "$list" --tasks spec_bench \
  --size "$EVAL_SIZE" --k 7 --max-new-tokens 128 --temperature 1.0 --seed 0 --out "$SHARD_OUT" --name eval_spec_bench_k7_t1
#    Paper Table 4: draft-length sensitivity of H-Spec and the parallel baselines.
sweep=$(for kind in hspec dspark dflash peagle; do
  if [[ " $KINDS " == *" $kind "* ]]; then echo "$kind=$RUNS/$kind/drafter"; fi
done | paste -sd, -)
if [ -n "$sweep" ]; then
  $HSPEC eval --keep-current --dtype "$DTYPE" --drafters "$sweep" \
    --tasks spec_bench --size "$EVAL_SIZE" --k 3,5,7 --max-new-tokens 128 --out "$SHARD_OUT" --name eval_spec_bench_k_sweep_greedy
fi
#    The paper's other suites at K = 7, greedy.
$HSPEC eval --keep-current --dtype "$DTYPE" --drafters "$list" \
  --tasks mt_bench,humaneval,gsm8k --size "$TASK_SIZE" --k 7 --max-new-tokens 128 --out "$SHARD_OUT" --name eval_tasks_k7_greedy
# 4. Every shard evaluated so far, merged into one file per evaluation, and the paper's claims, each with its
#    paired bootstrap CI (docs/claims.md), tested on them; then one table of every drafter across them
#    (eval_table.md, which results/comparison_long/README.md quotes): scripts/merge_comparison.sh.
HSPEC="$HSPEC" OUT="$OUT" STEPS="$STEPS" bash scripts/merge_comparison.sh
echo "[compare_long] done: $OUT"
