"""A diagnostic training split of Spec-Bench: its items outside every subset we measure or tune on.

Question this answers: is H-Spec's lower tau on Spec-Bench (1.7, against 2.4-2.5 in decode order on
held-out training text) a matter of the text it was trained on? Continue the shipped drafter on the
target's responses to Spec-Bench items *disjoint* from the evaluated ones and measure again. If tau
rises to the held-out level, in-domain data is the lever (and the legitimate version is training on the
source datasets' own train splits: WMT de-en, CNN/DailyMail, Natural Questions). If it does not, the
drafter's capacity or training budget is.

A drafter trained on this split is an experiment, never the shipped drafter: its tau on the evaluated
items would overstate what it does on unseen text of other sources.

Left out: the items `hspec eval --size 24` measures (global indices floor(i*480/24)) and the 18 items
`scripts/tune_on_dev_items.py` tunes on. Every kept item contributes its first turn. Writes the
normalized format ({id, category, turns}).

    .venv/bin/python scripts/build_spec_bench_diagnostic_split.py runs/data/prompts_spec_bench_split.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hspec.data.tasks import default_data_dir, load_task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_on_dev_items import dev_items  # noqa: E402

EVALUATED_SIZE = 24


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="prompt JSONL to write")
    args = parser.parse_args()
    text = (default_data_dir() / "spec_bench.jsonl").read_text()
    rows = [json.loads(line) for line in text.split("\n") if line.strip()]
    evaluated = {item.id for item in load_task("spec_bench", EVALUATED_SIZE).items}
    tuned = {row["id"] for items in dev_items(rows).values() for row in items}
    kept = [row for row in rows if row["id"] not in evaluated | tuned]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for row in kept:
            f.write(json.dumps({"id": row["id"], "category": row["category"], "turns": row["turns"][:1]}) + "\n")
    print(f"{len(kept)} of {len(rows)} items -> {args.out} (left out: {len(evaluated)} evaluated, {len(tuned)} tuned)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
