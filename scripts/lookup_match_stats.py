"""Drafts accepted after prompt lookup, grouped by the length m of the suffix match it drafted from.

Why: `hspec+ngram:P` verifies only min(K, 2m+1) of a lookup row's K drafts after an m-token match
(`hspec.drafters.lookup_first`), because a short match rarely predicts far. This measures how far it
does predict. It decodes the 18 dev items (`scripts/tune_on_dev_items.py`: Spec-Bench items outside
`hspec eval`'s subset, first turns) greedily with `hspec+ngram` (untrimmed, so every step verifies
all K drafts), checks each output against plain greedy decoding, and then replays each step: the
history a step drafted from is the prompt plus the tokens committed before it, and its match length
m is `longest_suffix_match(history, max_ngram).length` (m = 0: no match, so the trained drafter
drafted that step). Per m it reports the steps, the mean drafts accepted, what verifying only the
first min(K, 2m+1) would have kept, and the share of steps accepting none.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/lookup_match_stats.py  # writes results/lookup_match_stats.{json,md}

(27 min for the committed file, at 1 thread on the 2-core host shared with other jobs.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hspec.data.tasks import default_data_dir
from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters.lookup_first import LookupFirstDrafter
from hspec.drafters.ngram.suffix import longest_suffix_match
from hspec.models.loading import load_target
from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.runtime import build_drafter
from hspec.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tune_on_dev_items import dev_items  # noqa: E402


def match_lengths(prompt: list[int], output: list[int], num_accepted: list[int], max_ngram: int) -> list[int]:
    """The suffix-match length each step drafted from (0: none), replayed from the committed tokens.

    The prefill commits output[0]; step s then commits num_accepted[s] drafts and one new token, so
    step s drafted from prompt + output[:1 + sum_{j<s} (num_accepted[j] + 1)].
    """
    history = list(prompt) + list(output[:1])
    lengths = []
    for accepted in num_accepted:
        match = longest_suffix_match(history, max_ngram)
        lengths.append(0 if match is None else match.length)
        done = len(history) - len(prompt)
        history.extend(output[done:done + accepted + 1])
    return lengths


def group_by_match(steps: list[tuple[int, int]], K: int) -> list[dict]:
    """Per match length m (ascending): steps, mean accepted, mean accepted within min(K, 2m+1), share of 0.

    `steps` holds (m, drafts accepted) for every step; K is the drafts each step verified.
    """
    rows = []
    for m in sorted({m for m, _ in steps}):
        accepted = [a for mm, a in steps if mm == m]
        # m = 0: the trained drafter's step, which lookup's 2m+1 rule does not trim (None: no such number)
        cap = None if m == 0 else min(K, 2 * m + 1)
        rows.append({
            "match_length": m,
            "drafted_by": "model" if m == 0 else "lookup",
            "steps": len(accepted),
            "mean_accepted": sum(accepted) / len(accepted),
            "verified_if_trimmed": cap,
            "mean_accepted_if_trimmed": None if cap is None else sum(min(a, cap) for a in accepted) / len(accepted),
            "share_none_accepted": sum(a == 0 for a in accepted) / len(accepted),
        })
    return rows


def to_markdown(meta: dict, rows: list[dict], num_items: int, K: int) -> str:
    lines = [
        "# Drafts accepted after prompt lookup, by suffix-match length m\n",
        provenance_markdown(meta),
        f"\n{num_items} dev items (`scripts/tune_on_dev_items.py`), greedy, `{meta['settings']['drafter']}` "
        f"(lookup whenever the last token occurred before, otherwise the trained drafter), K={K}, every output "
        "equal to plain greedy decoding. A step's m is the longest suffix (at most "
        f"{meta['settings']['max_ngram']} tokens) of its history that occurred earlier; m = 0: no match, the "
        "trained drafter drafted. \"if trimmed\": the drafts among the first min(K, 2m+1) that were accepted "
        "(what `KIND+ngram:P` verifies after an m-token match, given the same history).\n",
        "| m | drafted by | steps | mean drafts accepted | verified if trimmed | mean accepted if trimmed "
        "| share accepting none |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        trimmed = "-" if r["mean_accepted_if_trimmed"] is None else f"{r['mean_accepted_if_trimmed']:.2f}"
        lines.append(f"| {r['match_length']} | {r['drafted_by']} | {r['steps']} | {r['mean_accepted']:.2f} "
                     f"| {r['verified_if_trimmed'] or '-'} | {trimmed} | {r['share_none_accepted']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="hspec+ngram",
                        help="a KIND+ngram spec without :P, so every step verifies all K drafts (default hspec+ngram)")
    parser.add_argument("--k", type=int, default=7, help="drafts per step K (default 7, as the dev-item runs)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per item (default 128, as the dev-item runs)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for lookup_match_stats.{json,md}")
    args = parser.parse_args()
    if args.k < 1:
        raise SystemExit(f"--k must be >= 1, got {args.k}")
    if args.max_new_tokens < 2:
        raise SystemExit(f"--max-new-tokens must be >= 2, got {args.max_new_tokens}")
    torch.set_num_threads(args.threads)
    target = load_target("smollm2")
    drafter = build_drafter(args.drafter, target)
    if not isinstance(drafter, LookupFirstDrafter) or drafter.trim_lookup:
        raise SystemExit(f"--drafter must be KIND+ngram without :P (so every step verifies K drafts), "
                         f"got {args.drafter!r}")
    eos = target.tokenizer.eos_token_ids
    plain = SpeculativeDecoder(target.model, build_drafter("none", target), args.k, eos)
    lookup = SpeculativeDecoder(target.model, drafter, args.k, eos)
    text = (default_data_dir() / "spec_bench.jsonl").read_text()
    items = [item for group in dev_items([json.loads(line) for line in text.split("\n") if line.strip()]).values()
             for item in group]
    steps: list[tuple[int, int]] = []  # (match length m, drafts accepted), every step of every item
    start = time.perf_counter()
    for n, item in enumerate(items, 1):
        prompt = target.tokenizer.encode_chat([{"role": "user", "content": item["turns"][0]}])
        reference = plain.generate([prompt], SamplingParams(), args.max_new_tokens).sequences[0].token_ids
        seq = lookup.generate([prompt], SamplingParams(), args.max_new_tokens).sequences[0]
        if seq.token_ids != reference:
            raise RuntimeError(f"{args.drafter} changed the greedy output of item {item['id']}: lossless bug")
        lengths = match_lengths(prompt, seq.token_ids, seq.num_accepted, drafter.max_ngram)
        steps.extend(zip(lengths, seq.num_accepted))
        print(f"[{n}/{len(items)}] {item['id']}: {len(seq.num_accepted)} steps ({time.perf_counter() - start:.0f} s)",
              flush=True)
    rows = group_by_match(steps, args.k)
    settings = {"target": "smollm2", "drafter": args.drafter, "K": args.k, "max_new_tokens": args.max_new_tokens,
                "max_ngram": drafter.max_ngram, "min_match": drafter.min_match, "items": len(items),
                "temperature": 0.0}
    command = "python scripts/lookup_match_stats.py " + " ".join(sys.argv[1:])
    meta = provenance(command.strip(), settings)
    payload = {**meta, "item_ids": [item["id"] for item in items], "by_match_length": rows}
    for path in write_results(args.out, "lookup_match_stats", payload, to_markdown(meta, rows, len(items), args.k)):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
