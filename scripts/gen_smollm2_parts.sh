#!/usr/bin/env bash
# Generate target responses in non-overlapping parts of one shuffled prompt order, two 1-thread
# processes side by side (on a 2-core CPU this beats one 2-thread process and lets features start early).
# Part 1 (prompts 0-191) is the first corpus (scripts/train_hspec_smollm2.sh). Rerun to resume.
set -euo pipefail
cd "$(dirname "$0")/.."
HSPEC=.venv/bin/hspec
export OMP_NUM_THREADS=1
part() {  # part NAME SKIP COUNT
  $HSPEC data generate --skip-prompts "$2" --num-prompts "$3" --max-new-tokens 192 --batch-size 32 \
    --out "runs/data/corpus_$1.jsonl"
}
(part part2 192 400; part part4 992 400) > runs/data/gen_a.log 2>&1 &
(part part3 592 400; part part5 1392 400) > runs/data/gen_b.log 2>&1 &
wait
