#!/usr/bin/env bash
# results/drafters_describe.{md,json}: every registered drafter kind's parameters, hidden layers read,
# target KV reused, drafter KV per token, per-sequence state and KV inflation on the embedded target
# (`hspec drafters describe`), then the KV inflation of the paper's targets (`hspec kv-table`). Seconds,
# random weights (no count depends on them); rerun after adding a kind.
set -euo pipefail
cd "$(dirname "$0")/.."
HSPEC=${HSPEC:-.venv/bin/hspec}
OUT=${OUT:-results}
{
  echo "# Drafter kinds for the embedded SmolLM2-135M-Instruct target"
  echo
  echo "Made by \`bash scripts/describe_drafters.sh\`: \`hspec drafters describe\` (this table; \`--json\` gives"
  echo "drafters_describe.json) and \`hspec kv-table\` (the second). Byte counts in bf16 (\`--dtype bf16\`)."
  echo "Drafter weights are random (parameter and memory counts do not depend on them). Trainable = the drafter's own"
  echo "parameters; total adds the target's frozen embedding/LM head it reads (tied in SmolLM2: counted once)."
  echo "Per-sequence state = the selected layers' hidden states at the last position (n_sel x H), kept independent of"
  echo "context length."
  echo
  $HSPEC drafters describe
  echo
  echo "KV inflation for the paper's targets (\`hspec kv-table\`; the paper's Table 1 gives 1.139 / 1.139 / 1.156 for"
  echo "DFlash and 1.000 for H-Spec):"
  echo
  $HSPEC kv-table
} > "$OUT/drafters_describe.md"
$HSPEC drafters describe --json > "$OUT/drafters_describe.json"
echo "wrote $OUT/drafters_describe.md and .json"
