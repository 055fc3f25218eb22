"""Replay `KIND:auto` with the drafter's outlook when the draft is charged by its positions, against the whole block.

Where a draft's cost grows with the positions drafted (`StepCost.draft_per_position`, measured by the step-cost
cycle), a row whose outlook expects a short block to pay best drafts only that many positions; before, it drafted
all K and paid for them. This replays both on `scripts/simulate_backoff.py`'s records of the `eval` items (the
greedy answers, with the drafter's K drafts at every position; on w4a8 the first m drafts and confidences of a
K-position draft are those of an m-position one, so the records hold what either rule would see) and the outlook's
features (`scripts/fit_outlook.py`'s cache beside them), at the same costs:

- `whole block`: the outlook decides whether a row drafts; it drafts K positions, charged draft + K per-position;
- `by position`: it drafts the outlook's best length m and verifies at most m, charged draft + m per-position;
- the back-off alone (no outlook, K positions) and the oracles (each step knowing the verdict: drafting exactly the
  accepted drafts, charged the whole block or by position).

Shown: predicted speed over plain decoding per task, over whole answers and their first 128 positions; and a check
that the replay of `by position` makes the same draft lengths as the real `KIND:auto` on the first item of each
task.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/replay_draft_positions.py [--records runs/backoff_sim_512]
        [--step-cost C] [--out results/adaptive_length/draft_positions/NAME]

Default costs: this machine's for `hspec:auto` on the w4a8 target (measured once and cached, as `hspec generate`
measures them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from fit_outlook import SHORT, estimates_of, load_features, more_items, prompt_of, truncated  # noqa: E402
from simulate_backoff import TASKS, K, check, item_sets, oracle, replay, speeds  # noqa: E402

from hspec.drafters.cost_aware import Backoff  # noqa: E402
from hspec.drafters.outlook import load_outlook  # noqa: E402
from hspec.drafters.step_cost import FORM, StepCost  # noqa: E402
from hspec.models.loading import load_target  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402
from hspec.runtime import build_drafter, shipped_drafter_path  # noqa: E402


def whole_block(cost: StepCost) -> StepCost:
    """`cost` with its positions' part charged to every draft: the draft of K positions, whatever is drafted."""
    return replace(cost, draft=cost.draft + K * cost.draft_per_position, draft_per_position=0.0)


def rules(rows: list[dict], estimates: dict[str, list[list[float]]], cost: StepCost) -> dict[str, dict[str, float]]:
    """Predicted speeds of each rule (module docstring) on `rows` at `cost`."""
    whole = whole_block(cost)
    return {"back-off, whole block": speeds(rows, lambda row: replay(row, whole, Backoff())[0]),
            "outlook, whole block": speeds(rows, lambda row: replay(row, whole, Backoff(),
                                                                   outlook=estimates[row["item"]])[0]),
            "outlook, by position": speeds(rows, lambda row: replay(row, cost, Backoff(),
                                                                   outlook=estimates[row["item"]])[0]),
            "oracle, whole block": speeds(rows, lambda row: oracle(row, whole)),
            "oracle, by position": speeds(rows, lambda row: oracle(row, cost))}


def drafted_shares(rows: list[dict], estimates: dict[str, list[list[float]]], cost: StepCost) -> dict[str, float]:
    """Per rule with the outlook: the share of steps that drafted, and the mean positions a drafting step drafted."""
    out = {}
    for name, charged in (("whole block", whole_block(cost)), ("by position", cost)):
        lengths = [n for row in rows for n in replay(row, charged, Backoff(), outlook=estimates[row["item"]])[1]]
        out[f"{name}: steps that verified drafts"] = sum(n > 0 for n in lengths) / max(len(lengths), 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=Path, default=Path("runs/backoff_sim_512"),
                        help="simulate_backoff.py's records (eval.jsonl), with fit_outlook.py's features of them")
    parser.add_argument("--drafter", default="hspec", help="the trained kind the records were made with")
    parser.add_argument("--dtype", default="w4a8", help="the target's dtype (the records')")
    parser.add_argument("--step-cost", default=None,
                        help=f"the costs, {FORM} in 1-token decodes (default: this machine's for DRAFTER:auto)")
    parser.add_argument("--out", type=Path, default=Path("results/adaptive_length/draft_positions"))
    args = parser.parse_args()
    try:
        given = None if args.step_cost is None else StepCost.parse(args.step_cost)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    target = load_target(None, dtype=args.dtype)
    cost = given or build_drafter(f"{args.drafter}:auto", target, K=K).cost
    checkpoint = shipped_drafter_path(args.drafter, target.name)
    outlook = load_outlook(checkpoint)
    if outlook is None:
        parser.error(f"the {args.drafter} drafter at {checkpoint} ships no outlook")
    rows = [json.loads(line) for line in (args.records / "eval.jsonl").read_text().splitlines()]
    items = {item.id: item for chosen in (*item_sets().values(), more_items()) for _, item in chosen}
    prompts = {row["item"]: prompt_of(target, row["item"], items) for row in rows}
    features = load_features(target, tuple(outlook.layers), rows, prompts, args.records / "outlook_features_eval.pt")
    estimates = estimates_of(outlook, rows, features)
    replays = {horizon: rules([row if horizon == "all" else truncated(row, SHORT) for row in rows], estimates, cost)
               for horizon in ("all", str(SHORT))}
    shares = drafted_shares(rows, estimates, cost)
    max_new_tokens = max(row.get("max_new_tokens", SHORT) for row in rows)
    checked = check(target, args.drafter, rows, cost, max_new_tokens, None, outlook, estimates)
    command = (f"python scripts/replay_draft_positions.py --records {args.records} --drafter {args.drafter} "
               f"--dtype {args.dtype} " + (f"--step-cost {args.step_cost} " if args.step_cost else "")
               + f"--out {args.out}")
    settings = {"drafter": args.drafter, "dtype": args.dtype, "records": str(args.records), "items": len(rows),
                "K": K, "step_cost": cost.to_dict(), "step_cost_given": given is not None, "short_horizon": SHORT,
                "threads": torch.get_num_threads()}
    payload = {"provenance": provenance(command, settings), "replays": replays, "drafted": shares, "check": checked}
    json_path, md_path = write_results(args.out, "draft_positions", payload, markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


def markdown(payload: dict) -> str:
    settings = payload["provenance"]["settings"]
    cost = StepCost(**settings["step_cost"])
    lines = [f"# `{settings['drafter']}:auto` with its outlook: the draft charged by position or as a whole block\n",
             provenance_markdown(payload["provenance"]),
             f"\nCosts, in 1-token decodes: a draft of m positions {cost.draft:.3f} + {cost.draft_per_position:.3f} m "
             f"(+ {cost.draft_per_key:.2g} a key), each verified token {cost.per_token:.3f} + {cost.per_token_key:.2g} "
             f"a key, the first {cost.first_token:.3f} on top. Whole block: every draft charged m = K = {K}.\n",
             "Replay checked against the real `:auto` drafting by position (the same drafts verified at every step): "
             + ", ".join(f"{c['item']} ({c['steps']} steps) {'same' if c['same_lengths'] else 'DIFFERENT'}"
                         for c in payload["check"]) + "\n",
             "Steps that verified drafts: " + ", ".join(f"{k} {v:.1%}" for k, v in payload["drafted"].items()) + "\n",
             f"## Predicted speed over plain decoding ({settings['items']} `eval` items)\n",
             "| horizon | rule | " + " | ".join(TASKS) + " | all | worst |", "|---|---|" + "---|" * (len(TASKS) + 2)]
    for horizon, by_rule in payload["replays"].items():
        for rule, s in by_rule.items():
            lines.append(f"| {horizon} | {rule} | " + " | ".join(f"{s[t]:.3f}" for t in TASKS)
                         + f" | {s['all']:.3f} | {min(s[t] for t in TASKS):.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
