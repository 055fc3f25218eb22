#!/usr/bin/env bash
# The training recipe at the paper's batch scale on a machine with one CUDA GPU, in one command:
#   0. the tests marked `gpu` (greedy losslessness of every drafter kind on CUDA in bf16, a training step of
#      every trained kind there), so "the same code runs on a GPU" is checked on the machine that trains;
#   1. the trainer's throughput there (`hspec bench train`: today's 4 x 16 blocks a step against the paper's
#      48 x 128 = 6,144, eager and compiled, from the same weights on the same number of blocks);
#   2. more target responses, generated in large batches;
#   3. the recipe on the given corpora and the new responses, features computed on the GPU, continuing a
#      drafter, with the step compiled;
#   4. the outputs (the drafter exported in bf16, the new responses, the run's history, the results) cut into
#      pieces of at most 16 MiB with their sha256 sums, so they move between machines in small transfers.
#
# Usage: scripts/gpu_recipe.sh WORK_DIR
# Inputs (environment; defaults in brackets):
#   TARGET   [smollm2]  the target's weights: an HF checkpoint dir, a .gguf file or 'smollm2' (embedded)
#   CORPORA  [results/train_data/corpus_part1..13.jsonl]  comma-separated corpora to train on (their order
#            fixes the held-out split), the new responses are added after them
#   INIT     [src/hspec/assets/hspec-smollm2-135m-instruct]  the drafter to continue ("" trains a fresh one)
#   PROMPTS  [train_prompts.jsonl]  prompts to answer (shipped in hspec/data, or a path); SKIP_PROMPTS [3232]
#            skips the ones results/train_data already answered; NUM_PROMPTS [8000]
#   GEN_BATCH [256], GEN_SECONDS [180]  prompts per generation batch; the generation's time limit (a stopped
#            generation keeps its finished batches and resumes on a rerun)
#   SEQS [48], ANCHORS [128], LR [6e-4], STEPS [300]  the step: sequences x anchors per sequence (the paper's
#            6,144 blocks), peak learning rate, optimizer steps
#   BENCH_BLOCKS [18432]  blocks per configuration of step 1 (0 skips it); BENCH_PRECISION [bf16-autocast]
#            the bench's precision (fp32 where bf16 is software: a CPU without AVX512-BF16);  TESTS [1] (0 skips
#            step 0)
#   PIECE [16M]  the largest piece;  PYTHON [python3];  DEVICE [cuda]
#   COMPILE [1]  0 runs the step eager (in the bench too): with DEVICE=cpu and small sizes the whole recipe runs
#            on a CPU in minutes, which tests/test_gpu_recipe.py does to check its plumbing
# With --corpus the target computes a step's features when the step loads its sequences, all of them in one
# forward (`OnlineFeatures.load_many`: 1 target forward a step at 48 x 128, not 48).
# Every step resumes when the script is rerun with the same WORK_DIR. Outputs: WORK_DIR/out/ (pieces,
# SHA256SUMS and the line that puts each file together again).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:?usage: $0 WORK_DIR}
TARGET=${TARGET:-smollm2}
CORPORA=${CORPORA:-$(printf "%s\n" results/train_data/corpus_part{1..13}.jsonl | paste -sd,)}
INIT=${INIT-src/hspec/assets/hspec-smollm2-135m-instruct}
PROMPTS=${PROMPTS:-train_prompts.jsonl}
SKIP_PROMPTS=${SKIP_PROMPTS:-3232}
NUM_PROMPTS=${NUM_PROMPTS:-8000}
GEN_BATCH=${GEN_BATCH:-256}
GEN_SECONDS=${GEN_SECONDS:-180}
SEQS=${SEQS:-48}
ANCHORS=${ANCHORS:-128}
LR=${LR:-6e-4}
STEPS=${STEPS:-300}
BENCH_BLOCKS=${BENCH_BLOCKS:-18432}
BENCH_PRECISION=${BENCH_PRECISION:-bf16-autocast}
TESTS=${TESTS:-1}
PIECE=${PIECE:-16M}
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
COMPILE=${COMPILE:-1}
compile_bench=off,on compile_train=(--compile-step)
if [ "$COMPILE" = 0 ]; then compile_bench=off compile_train=(); fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
HSPEC="$PYTHON -m hspec.cli"
mkdir -p "$WORK/data" "$WORK/results" "$WORK/out"

# 0. The GPU tests (a failure is recorded, and the recipe goes on: its numbers are still worth having).
if [ "$TESTS" != 0 ]; then
  $PYTHON -m pytest -m gpu -q tests/ -p no:cacheprovider >"$WORK/results/gpu_tests.log" 2>&1 \
    && echo "[gpu] tests marked gpu: passed" || echo "[gpu] tests marked gpu: FAILED (see $WORK/results/gpu_tests.log)"
  tail -3 "$WORK/results/gpu_tests.log"
fi

# 1. Throughput: today's step against the paper's, eager and compiled (round 0, the compile, is untimed); a
#    round is a whole number of steps of both (the least common multiple of 64 and SEQS x ANCHORS blocks).
if [ "$BENCH_BLOCKS" != 0 ] && [ ! -f "$WORK/results/train_throughput_gpu.md" ]; then
  round=$((SEQS * ANCHORS)); a=$round; b=64
  while [ "$b" != 0 ]; do t=$((a % b)); a=$b; b=$t; done
  round=$((round * 64 / a))
  $HSPEC bench train --target "$TARGET" --device "$DEVICE" --features "$WORK/features/bench" --corpus "${CORPORA%%,*}" \
    --seqs-per-step 4,"$SEQS" --anchors-per-seq 16,"$ANCHORS" --compile "$compile_bench" --blocks "$BENCH_BLOCKS" \
    --precision "$BENCH_PRECISION" \
    --round-blocks "$round" --out "$WORK/results" --name train_throughput_gpu \
    >"$WORK/results/train_throughput_gpu.log" 2>&1 || echo "[gpu] bench train failed (see its log)"
fi

# 2. The target's greedy responses, in large batches.
timeout "$GEN_SECONDS" $HSPEC data generate --target "$TARGET" --device "$DEVICE" --prompts "$PROMPTS" \
  --skip-prompts "$SKIP_PROMPTS" --num-prompts "$NUM_PROMPTS" --max-new-tokens 192 --batch-size "$GEN_BATCH" \
  --out "$WORK/data/corpus_gpu.jsonl" >"$WORK/results/generate.log" 2>&1 || true
corpora=$CORPORA
if [ -s "$WORK/data/corpus_gpu.jsonl" ]; then corpora="$corpora,$WORK/data/corpus_gpu.jsonl"; fi
echo "[gpu] $(wc -l <"$WORK/data/corpus_gpu.jsonl" 2>/dev/null || echo 0) new responses"

# 3. The recipe at the paper's batch scale, features computed on the GPU, the step compiled.
start=(--draft-vocab 8192)  # a fresh drafter: the shipped drafter's vocabulary size
if [ -n "$INIT" ]; then start=(--init-from "$INIT"); fi
$HSPEC train --target "$TARGET" --drafter hspec --corpus "$corpora" --device "$DEVICE" "${start[@]}" \
  --seqs-per-step "$SEQS" --anchors-per-seq "$ANCHORS" --lr "$LR" --steps "$STEPS" \
  --val-every $(((STEPS + 1) / 2)) "${compile_train[@]}" --out "$WORK/run" >"$WORK/results/train.log" 2>&1
$HSPEC export-drafter "$WORK/run/drafter" "$WORK/export" --dtype bfloat16

# 4. Pieces of at most $PIECE, with their sums and the command that joins each file again.
cut_pieces() {  # cut_pieces FILE NAME
  [ -f "$1" ] || return 0
  split -b "$PIECE" -d -a 3 "$1" "$WORK/out/$2.part"
  (cd "$(dirname "$1")" && sha256sum "$(basename "$1")") | sed "s|  .*|  $2|" >>"$WORK/out/SHA256SUMS"
  echo "cat $2.part* > $2" >>"$WORK/out/JOIN"
}
rm -f "$WORK/out/"*
for f in "$WORK/export/"*; do cut_pieces "$f" "drafter_$(basename "$f")"; done
cut_pieces "$WORK/data/corpus_gpu.jsonl" corpus_gpu.jsonl
cut_pieces "$WORK/run/history.jsonl" history.jsonl
for f in "$WORK/results/"*; do cut_pieces "$f" "results_$(basename "$f")"; done
echo "sha256sum -c SHA256SUMS" >>"$WORK/out/JOIN"
ls -l "$WORK/out"
echo "[gpu] done: $WORK/out (run JOIN there to put the files together)"
