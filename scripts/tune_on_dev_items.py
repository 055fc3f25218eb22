"""Tune decoding settings on Spec-Bench items that `hspec eval`'s subset leaves out (greedy, K = 7).

`hspec eval --size 24` takes the items at global indices 0, 20, 40, ...; this script takes mt_bench
items 5, 33, 67 and, per other category, its category-local items 3, 13, 23 (18 items, first turns),
so choices made here are not made on the evaluated subset. Every method runs on every item,
interleaved with plain decoding; outputs must equal plain greedy decoding. Prints tau / speedup per
category and over all items. This is how P = 0.4 (`hspec+ngram:0.4`) and the lookup-first rule were
chosen, and how drafter v7 was compared with v6 before shipping.

    .venv/bin/python scripts/tune_on_dev_items.py hspec+ngram hspec+ngram:0.3 hspec+ngram:0.4 \\
        hspec=runs/train/hspec_v6/drafter [--out results/DIR/dev_items.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from hspec.data.tasks import default_data_dir
from hspec.decoding.generate import SpeculativeDecoder
from hspec.models.loading import load_target
from hspec.provenance import provenance, provenance_markdown
from hspec.runtime import build_drafter
from hspec.sampling import SamplingParams

CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]


def dev_items(rows: list[dict]) -> dict[str, list[dict]]:
    """The 18 tuning items by category; none of them is in `hspec eval`'s evenly spaced subset."""
    items = {"mt_bench": [rows[i] for i in (5, 33, 67)]}
    for category in CATEGORIES[1:]:
        in_category = [r for r in rows if r["category"] == category]
        items[category] = [in_category[i] for i in (3, 13, 23)]
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("methods", nargs="+", help="drafter specs as for --drafter, optionally SPEC=CHECKPOINT_DIR")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the lines to this markdown file, under the command and provenance")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_target("smollm2")
    decoders = {}
    for method in ["none", *args.methods]:
        spec, _, path = method.partition("=")
        decoders[method] = SpeculativeDecoder(target.model, build_drafter(spec, target, path or None), args.k,
                                              target.tokenizer.eos_token_ids)
    text = (default_data_dir() / "spec_bench.jsonl").read_text()
    rows = [json.loads(line) for line in text.split("\n") if line.strip()]
    totals: dict[str, list[float]] = {}  # method -> [tokens, steps, decode seconds], over all items
    lines = []
    for category, items in dev_items(rows).items():
        sums: dict[str, list[float]] = {}
        for item in items:
            prompt = target.tokenizer.encode_chat([{"role": "user", "content": item["turns"][0]}])
            reference = None
            for method, decoder in decoders.items():
                out = decoder.generate([prompt], SamplingParams(), args.max_new_tokens, seeds=[0])
                seq = out.sequences[0]
                reference = seq.token_ids if reference is None else reference
                if seq.token_ids != reference:
                    raise RuntimeError(f"{method} changed the greedy output: lossless bug")
                for acc in (sums, totals):
                    entry = acc.setdefault(method, [0.0, 0.0, 0.0])
                    entry[0] += len(seq.token_ids)
                    entry[1] += len(seq.num_accepted) or len(seq.token_ids)
                    entry[2] += out.decode_s
        lines.append(f"{category} {_summary(sums)}")
        print(lines[-1], flush=True)
    lines.append(f"all {_summary(totals)}")
    print(lines[-1], flush=True)
    if args.out is not None:
        _write_markdown(args.out, lines, vars(args))


def _write_markdown(path: Path, lines: list[str], settings: dict) -> None:
    """The printed lines under the command, date, commit and machine (`hspec.provenance.provenance`)."""
    command = "python scripts/tune_on_dev_items.py " + " ".join(sys.argv[1:])
    meta = provenance(command, {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# Dev-item tuning run\n\n" + provenance_markdown(meta)
                    + "\n18 Spec-Bench items outside the evaluated subset, greedy; each line: method tau / speedup "
                    "over plain decoding (interleaved)\n\n```\n" + "\n".join(lines) + "\n```\n")
    print(f"wrote {path}")


def _summary(sums: dict[str, list[float]]) -> str:
    plain_itl = sums["none"][2] / sums["none"][0]
    return ", ".join(f"{m} {t / s:.2f} / {plain_itl / (sec / t):.2f}x" for m, (t, s, sec) in sums.items())


if __name__ == "__main__":
    main()
