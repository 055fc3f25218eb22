#!/usr/bin/env bash
# Rebuild the shipped H-Spec drafter for the embedded default target (SmolLM2-135M-Instruct) on a CPU,
# then measure it. Every step resumes if interrupted: rerun the script.
# Settings are the ones the committed drafter and results/ were made with (see README, "Results").
set -euo pipefail
cd "$(dirname "$0")/.."
HSPEC=.venv/bin/hspec
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

# 1. The target's own greedy responses to shuffled training prompts (we used the first 192).
$HSPEC data generate --num-prompts 192 --max-new-tokens 192 --batch-size 32 --out runs/data/corpus_part1.jsonl
# 2. Target features (5 selected layers' hidden states, their K/V, final hidden), cached once.
$HSPEC data features --corpus runs/data/corpus_part1.jsonl --out runs/features/part1
# 3. The unified recipe: 0.1 CE + 0.9 TV, gamma 4, AdamW 6e-4, 1% warmup + half-cosine.
$HSPEC train --drafter hspec --features runs/features/part1 --out runs/train/hspec --steps 1200 --val-every 100
# 4. Ship it (bf16 weights) and report.
$HSPEC export-drafter runs/train/hspec/drafter src/hspec/assets/hspec-smollm2-135m-instruct --dtype bf16
$HSPEC train-report runs/train/hspec --out results/train_hspec_smollm2.md --title "H-Spec on SmolLM2-135M-Instruct (CPU)"
# 5. Greedy K=7 on a fixed Spec-Bench subset, interleaved with plain decoding and n-gram drafting.
$HSPEC eval --drafters ngram,hspec --tasks spec_bench --size 24 --k 7 --max-new-tokens 128 --out results
