"""What a verify cost inside an evaluation, fitted from its own per-step records, beside the costs its rule used.

`hspec eval` records, per item and method, the decode time, the plain decoding's time of the same item in the
same round, and every step's verified drafts (`num_drafted`). For a method whose drafter runs no model (prompt
lookup: `ngram`, `ngram:auto`) a step's time is a plain decode's plus the verify's extra rows, so over the items

    decode_s / (plain_decode_s / plain steps) - steps
        = first_token * (steps verifying drafts) + per_token * (drafts verified)

and a least-squares fit of the two costs (in 1-token decodes) says what the verifies cost in that run, against
the `StepCost` the run measured for `ngram:auto` at its start (its settings' `step_costs`), which is what
`ngram:auto`'s rule decided by.

A joint fit over the items of all four kinds the run holds (`ngram`, `ngram:auto`, `hspec`, `hspec:auto`) adds
two terms: a surcharge on every step of a speculative run, drafting or not (`tax`), and the H-Spec drafter's
propose on each step it verified drafts (`draft`; a step where it ran and verified none is not in the records,
so it is missed):

    decode_s / (plain_decode_s / plain steps) - steps
        = tax * steps + first_token * (steps verifying drafts) + per_token * (drafts verified)
          + draft * (H-Spec steps verifying drafts)

    python scripts/fit_step_costs.py results/adaptive_length/size24/eval_spec_bench_tasks_k7_greedy_w4a8_t2.json
        [--out results/adaptive_length/size24]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from hspec.provenance import provenance, provenance_markdown, write_results

LOOKUP_METHODS = ("ngram", "ngram:auto")  # drafted without a model: their steps add only verify rows
LOOKUP_COSTS = "ngram:auto"  # whose costs, measured at the run's start, the fitted ones are set beside
JOINT_METHODS = ("ngram", "ngram:auto", "hspec", "hspec:auto")  # the joint fit's items
JOINT_TERMS = ("tax", "first_token", "per_token", "draft")


def fit(records: list[dict], method: str) -> dict[str, float] | None:
    """first_token and per_token (1-token decodes) fitted over `method`'s items; None without its records."""
    rows, extra = [], []
    for record in records:
        if record["method"] != method:
            continue
        unit = record["plain_decode_s"] / max(record["plain_tokens"] - 1, 1)  # one plain step
        # `hspec eval` keeps num_drafted only where some step verified fewer than K: else every step verified K
        drafted = record.get("num_drafted", [record["K"]] * len(record["num_accepted"]))
        rows.append([sum(1 for n in drafted if n > 0), sum(drafted)])
        extra.append(record["decode_s"] / unit - len(drafted))
    if not rows:
        return None
    (first, per_token), *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(extra), rcond=None)
    steps, drafts = np.array(rows, dtype=float).sum(axis=0)
    return {"items": len(rows), "first_token": float(first), "per_token": float(per_token),
            "steps_verifying": int(steps), "drafts_verified": int(drafts),
            "verify_of_7": float(first + 7 * per_token)}


def joint_fit(records: list[dict]) -> dict[str, float] | None:
    """tax, first_token, per_token and draft (1-token decodes) fitted over the items of `JOINT_METHODS` (module
    docstring), with each method's mean residual a step; None unless every one of them has items."""
    rows, extra, methods = [], [], []
    for record in records:
        if record["method"] not in JOINT_METHODS:
            continue
        unit = record["plain_decode_s"] / max(record["plain_tokens"] - 1, 1)
        drafted = record.get("num_drafted", [record["K"]] * len(record["num_accepted"]))
        verifying = sum(1 for n in drafted if n > 0)
        model = verifying if record["method"].startswith("hspec") else 0
        rows.append([len(drafted), verifying, sum(drafted), model])
        extra.append(record["decode_s"] / unit - len(drafted))
        methods.append(record["method"])
    if set(methods) != set(JOINT_METHODS):
        return None
    x, y = np.array(rows, dtype=float), np.array(extra)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ coef
    per_method = {m: float(sum(r for r, k in zip(residual, methods) if k == m)
                           / sum(row[0] for row, k in zip(rows, methods) if k == m)) for m in JOINT_METHODS}
    return {"items": len(rows), **{term: float(c) for term, c in zip(JOINT_TERMS, coef)},
            "verify_of_7": float(coef[1] + 7 * coef[2]), "residual_per_step": per_method}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("eval_json", type=Path, help="an `hspec eval` results JSON with per-step records")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: beside the JSON)")
    args = parser.parse_args()
    data = json.loads(args.eval_json.read_text())
    given = data["provenance"]["settings"].get("step_costs", {})
    rows = []
    for method in LOOKUP_METHODS:
        fitted = fit(data["records"], method)
        if fitted is None:
            continue
        used = given.get(LOOKUP_COSTS)
        rows.append({"method": method, "fitted": fitted, "used": used})
    if not rows:
        parser.error(f"{args.eval_json} has no per-step records of {', '.join(LOOKUP_METHODS)}")
    command = f"python scripts/fit_step_costs.py {args.eval_json}"
    payload = {"provenance": provenance(command, {"eval": str(args.eval_json),
                                                  "eval_commit": data["provenance"].get("commit")}),
               "results": rows, "joint": joint_fit(data["records"]), "used_hspec": given.get("hspec:auto")}
    json_path, md_path = write_results(args.out or args.eval_json.parent, "fit_step_costs", payload, markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


def markdown(payload: dict) -> str:
    lines = ["# What a verify cost inside an evaluation, fitted from its per-step records\n",
             provenance_markdown(payload["provenance"]),
             "\nIn 1-token decodes of the same items' plain decoding, interleaved (module docstring of "
             "`scripts/fit_step_costs.py`); `used`: the costs measured at the run's start for `ngram:auto`, which its "
             "rule decided by. Where every step verifies K drafts or none (`ngram`), only a verify of K is "
             "determined, not its split into first token and per token.\n",
             "| method | items | steps verifying | drafts verified | first token (fitted) | per token (fitted) | "
             "a verify of 7 (fitted) | first token (used) | per token (used) | a verify of 7 (used) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in payload["results"]:
        f, u = row["fitted"], row["used"]
        used = ("| - | - | - |" if u is None else
                f"| {u['first_token']:.3f} | {u['per_token']:.3f} | {u['first_token'] + 7 * u['per_token']:.3f} |")
        lines.append(f"| {row['method']} | {f['items']} | {f['steps_verifying']} | {f['drafts_verified']} | "
                     f"{f['first_token']:.3f} | {f['per_token']:.3f} | {f['verify_of_7']:.3f} " + used)
    joint, used = payload.get("joint"), payload.get("used_hspec")
    if joint is not None:
        lines += ["\nThe joint fit over the items of " + ", ".join(f"`{m}`" for m in JOINT_METHODS) + " (module "
                  "docstring): a surcharge on every step of a speculative run (`tax`), and H-Spec's propose on each "
                  "step it verified drafts (`draft`), beside the costs `hspec:auto` decided by (`used`).\n",
                  "| | items | tax a step | first token | per token | a verify of 7 | draft |",
                  "|---|---|---|---|---|---|---|",
                  f"| fitted | {joint['items']} | {joint['tax']:.3f} | {joint['first_token']:.3f} | "
                  f"{joint['per_token']:.3f} | {joint['verify_of_7']:.3f} | {joint['draft']:.3f} |"]
        if used is not None:
            lines.append(f"| used | - | 0 | {used['first_token']:.3f} | {used['per_token']:.3f} | "
                         f"{used['first_token'] + 7 * used['per_token']:.3f} | {used['draft']:.3f} |")
        lines.append("\nWhat the fit leaves, a step, by method: " + ", ".join(
            f"`{m}` {r:+.3f}" for m, r in joint["residual_per_step"].items()) + ".")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
