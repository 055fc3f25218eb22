"""Prompt lookup's drafts under `KIND:auto`, replayed on recorded outputs: one record for all of a row's lookups or
one per match length, and n-gram rows without a match drafting nothing or verifying their padding.

Prompt lookup's drafts at an output position depend only on the committed prefix (the prompt and the output so
far), which the records of `scripts/simulate_backoff.py` hold with the H-Spec drafter's proposal at every position
(`runs/backoff_sim/`, made there). So `ngram:auto` and `hspec+ngram:auto` replay offline as `hspec:auto` does
there: lookup rows found in the history, model rows taken from the recorded proposals, each row's rule its own
`RowState` (`choose_lookup`, `choose`, `record`, `takes_turn`), each step charged `StepCost.of` (a lookup row pays
no draft, as the rule believes; every n-gram step its lookup's measured cost). The rules compared:

- `per match` (the rule now): a record per match length, 1, 2 and 3 or more tokens (`lookup_bucket`);
- `one record`: every lookup of a row judged by one record (the rule given no match length);
- for `ngram:auto` also `padding verified`: a row without a match proposes its last token K times and one record
  judges it with the lookups (what `ngram` did before it drafted nothing there), and `ngram` itself, every step
  verifying all K drafts, with and without that padding.

The replay of `per match` is checked against the real `:auto` runs of both kinds on the first item of each task
(the same drafts verified at every step: the `check` rows).

`--charge-from` charges each step what `scripts/fit_step_costs.py`'s joint fit of an evaluation found a step
costs inside real runs (its surcharge on every step, first-token, per-token and draft costs) while the rules
still decide by the measured costs, as the real `:auto` does: a check of how far the measured costs are from
what runs pay (the results then go beside that fit, `fit_step_costs.json`'s folder, as `lookup_sim_charged`).

    .venv/bin/python scripts/simulate_lookup.py
        [--step-cost-from results/adaptive_length/size24/eval_spec_bench_tasks_k7_greedy_w4a8_t2.json]
        [--records runs/backoff_sim] [--out results/adaptive_length/lookup_sim]
        [--charge-from results/adaptive_length/size24/fit_step_costs.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from simulate_backoff import MAX_NEW_TOKENS, TASKS, K, charged_from, item_sets, record, speeds  # noqa: E402

from hspec.decoding.generate import SpeculativeDecoder  # noqa: E402
from hspec.drafters import create_drafter  # noqa: E402
from hspec.drafters.cost_aware import Backoff, RowState  # noqa: E402
from hspec.drafters.lookup_first import LookupFirstDrafter  # noqa: E402
from hspec.drafters.ngram.suffix import longest_suffix_match  # noqa: E402
from hspec.drafters.step_cost import StepCost  # noqa: E402
from hspec.models.loading import load_target  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402
from hspec.runtime import build_drafter  # noqa: E402
from hspec.sampling import SamplingParams  # noqa: E402

KINDS = ("ngram", "hspec+ngram")
RULES = {"ngram": ("per match", "one record", "padding verified", "all K", "all K, padding verified"),
         "hspec+ngram": ("per match", "one record")}


def accepted(drafts: list[int], ahead: list[int], n: int) -> int:
    """Leading drafts among the first n that equal the tokens the target output after the anchor."""
    count = 0
    while count < min(n, len(ahead), len(drafts)) and drafts[count] == ahead[count]:
        count += 1
    return count


def replay(row: dict, prompt: list[int], kind: str, rule: str, cost: StepCost, max_ngram: int,
           charge: StepCost | None = None, tax: float = 0.0) -> tuple[float, list[int]]:
    """`kind`:auto (or `ngram` verifying all K, rules "all K...") under `rule` on one recorded item: its steps'
    summed cost (decodes) and drafts verified per step. The rule decides by `cost`; each step is charged by
    `charge` (default `cost`) plus `tax`, and every n-gram step its lookup's measured cost."""
    tokens, steps = row["tokens"], row["steps"]
    free = replace(cost, draft=0.0, draft_per_key=0.0)  # what a lookup row pays (`CostAwareDrafter.free_cost`)
    charge = cost if charge is None else charge
    free_charge = replace(charge, draft=0.0, draft_per_key=0.0)
    state, position, total, lengths = RowState(), 0, 0.0, []
    while position < len(steps):
        keys, model_drafts, confidence = steps[position]
        history = prompt + tokens[:position + 1]  # ends with the anchor
        match = longest_suffix_match(history, max_ngram)
        turn = state.takes_turn()
        state.pending = None
        padded = kind == "ngram" and match is None and rule.endswith("padding verified")
        if match is not None or padded:  # a lookup row: free, it drafts even while its row backs off
            drafts = [history[-1]] * K if match is None else match.continuation(history, K)
            if rule.startswith("all K"):
                n = K
            else:
                n = state.choose_lookup(K, K, keys, free, match.length if match and rule == "per match" else 0)
            spent = free_charge.of(n, keys, n) + (cost.draft if kind == "ngram" else 0.0)
        elif kind == "ngram":  # no match: a plain decode step
            drafts, n, spent = [], 0, free_charge.of(0, keys, 0) + cost.draft
        elif turn:
            drafts, n = model_drafts, state.choose(confidence, keys, cost, Backoff())
            spent = charge.of(n, keys, K)
        else:
            drafts, n, spent = [], 0, 1.0
        count = accepted(drafts, tokens[position + 1: len(steps)], n)
        state.record(count)
        total += spent + tax
        lengths.append(n)
        position += count + 1
    return total, lengths


def check(target, rows: list[dict], prompts: dict[str, list[int]], costs: dict[str, StepCost],
          max_ngrams: dict[str, int]) -> list[dict]:
    """The first recorded item of each task decoded by the real `KIND:auto`: the same lengths as the replay?"""
    out = []
    for kind in KINDS:
        drafter = build_drafter(f"{kind}:auto", target, step_cost=costs[kind])
        decoder = SpeculativeDecoder(target.model, drafter, K, target.tokenizer.eos_token_ids)
        for task in TASKS:
            row = next(row for row in rows if row["task"] == task)
            real = decoder.generate([prompts[row["item"]]], SamplingParams(), MAX_NEW_TOKENS).sequences[0]
            replayed = replay(row, prompts[row["item"]], kind, "per match", costs[kind], max_ngrams[kind])[1]
            out.append({"kind": kind, "item": row["item"], "steps": len(real.num_drafted),
                        "same_lengths": list(real.num_drafted) == replayed})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-cost-from", type=Path,
                        default=Path("results/adaptive_length/size24/eval_spec_bench_tasks_k7_greedy_w4a8_t2.json"),
                        help="a results JSON whose provenance settings hold the step costs of ngram:auto and "
                        "hspec+ngram:auto")
    parser.add_argument("--records", type=Path, default=Path("runs/backoff_sim"),
                        help="simulate_backoff.py's records (made there if missing)")
    parser.add_argument("--out", type=Path, default=Path("results/adaptive_length/lookup_sim"))
    parser.add_argument("--charge-from", type=Path, default=None,
                        help="a fit_step_costs.json whose joint fit each step is charged by (module docstring)")
    args = parser.parse_args()
    charge, tax = (None, 0.0) if args.charge_from is None else charged_from(args.charge_from)
    given = json.loads(args.step_cost_from.read_text())["provenance"]["settings"]["step_costs"]
    costs = {kind: StepCost(**given[f"{kind}:auto"]) for kind in KINDS}
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    target = load_target(None, dtype="w4a8")
    max_ngrams = {"ngram": create_drafter("ngram", target.config).max_ngram,  # the drafters' defaults
                  "hspec+ngram": inspect.signature(LookupFirstDrafter).parameters["max_ngram"].default}
    args.records.mkdir(parents=True, exist_ok=True)
    sets = item_sets()
    rows = {name: record(target, "hspec", items, args.records / f"{name}.jsonl") for name, items in sets.items()}
    prompts = {item.id: target.tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}])
               for items in sets.values() for _, item in items}
    checked = check(target, rows["eval"], prompts, costs, max_ngrams)
    results = [{"kind": kind, "rule": rule,
                **{name: speeds(r, lambda row, k=kind, u=rule: replay(row, prompts[row["item"]], k, u, costs[k],
                                                                       max_ngrams[k], charge, tax)[0])
                   for name, r in rows.items()}}
               for kind in KINDS for rule in RULES[kind]]
    settings = {"K": K, "max_new_tokens": MAX_NEW_TOKENS, "step_costs": {k: c.to_dict() for k, c in costs.items()},
                "max_ngram": max_ngrams, "items": {name: len(r) for name, r in rows.items()},
                "threads": torch.get_num_threads(),
                **({} if charge is None else {"charged": {**charge.to_dict(), "tax": tax},
                                              "charged_from": str(args.charge_from)})}
    command = f"python scripts/simulate_lookup.py --step-cost-from {args.step_cost_from}"
    if args.charge_from is not None:
        command += f" --charge-from {args.charge_from}"
    payload = {"provenance": provenance(command, settings), "check": checked, "results": results}
    out, stem = (args.out, "lookup_sim") if charge is None else (args.charge_from.parent, "lookup_sim_charged")
    json_path, md_path = write_results(out, stem, payload, markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


def markdown(payload: dict) -> str:
    lines = ["# Prompt lookup's drafts under `KIND:auto`, replayed on recorded outputs\n",
             provenance_markdown(payload["provenance"]),
             "\nPredicted speed over plain decoding (plain steps over the replayed steps' costs in decodes, greedy, "
             f"K = {K}, at most {MAX_NEW_TOKENS} new tokens; the costs: settings' step_costs, and where the settings "
             "name `charged`, each step charged those and their surcharge `tax` instead). Rules: `per match` "
             "a record per match length (1, 2, 3+ tokens), the rule now; `one record` one for all lookups; "
             "`padding verified` (n-gram) a row without a match verifying its last token repeated, judged with the "
             "lookups; `all K` the kind without `:auto`, verifying every draft.\n",
             "Replay checked against the real `:auto` runs (the same drafts verified at every step): "
             + ", ".join(f"{c['kind']} {c['item']} ({c['steps']} steps) "
                         f"{'same' if c['same_lengths'] else 'DIFFERENT'}" for c in payload["check"]) + "\n",
             "| kind | rule | set | " + " | ".join(TASKS) + " | all | worst |",
             "|---|---|---|" + "---|" * (len(TASKS) + 2)]
    for r in payload["results"]:
        for name in ("dev", "eval"):
            s = r[name]
            lines.append(f"| {r['kind']} | {r['rule']} | {name} | " + " | ".join(f"{s[t]:.3f}" for t in TASKS)
                         + f" | {s['all']:.3f} | {min(s[t] for t in TASKS):.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
