"""Where the oracle's gain over `KIND:auto` lies, on the records of `scripts/simulate_backoff.py`.

At every output position of every recorded item: would drafting there pay (the target accepts n >= 1 of the
recorded drafts and n + 1 tokens cost less than a plain step's 1 per token, by the given step costs), and what
was known before paying for the draft (the position in the answer, the longest suffix of prompt + output so far
that occurred earlier in it, up to 3 tokens, whether drafting paid at the position before) or once drafted (the
first draft's confidence). Every position is
counted, not only those a decoding visits as an anchor, so read the shares as where the chances lie, not as a
rule's speed (the replay gives that).

    .venv/bin/python scripts/backoff_signals.py --records runs/backoff_sim_512 \
        [--step-cost-from results/adaptive_length/size24_pair/eval_spec_bench_tasks_k7_greedy_w4a8_t2.json] \
        --out results/adaptive_length/backoff_sim/zen1_long512_xeon_costs
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))

from simulate_backoff import MAX_NEW_TOKENS, K, accepted_at, item_sets  # noqa: E402

from hspec.drafters.step_cost import StepCost  # noqa: E402
from hspec.models.loading import load_target  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402

LATE = 128  # output positions from here on are "late": beyond what `hspec eval`'s 128-token answers reach
MATCH_CAP = 3  # suffix matches of 3 tokens or more are one group


def repeated_suffix(history: list[int], cap: int = MATCH_CAP) -> int:
    """The longest n <= cap whose last n tokens of `history` also occur earlier in it."""
    n = 0
    while n < cap:
        suffix = history[-(n + 1):]
        if not any(history[i:i + n + 1] == suffix for i in range(len(history) - n - 1)):
            break
        n += 1
    return n


def tally(records: list[dict], prompts: dict[str, list[int]], cost: StepCost) -> dict[str, dict[str, dict]]:
    """Per signal and value: positions, the share where drafting pays, and the decodes gained per position."""
    groups: dict[str, dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0, 0.0]))
    for row in records:
        prompt, tokens = prompts[row["item"]], row["tokens"]
        paid_before = None  # whether drafting paid at the position before
        for position, (keys, _, confidence) in enumerate(row["steps"]):
            accepted = accepted_at(row, position, K)
            step = cost.of(accepted, keys, K) if accepted else float("inf")
            gain = accepted + 1 - step if accepted + 1 > step else 0.0
            match = repeated_suffix(prompt + tokens[:position + 1])
            late = "late" if position >= LATE else "early"
            values = {"all": "all", "part of the answer": late,
                      "repeated suffix (tokens)": f"{match}+" if match == MATCH_CAP else str(match),
                      "repeated suffix, by part": f"{match}{'+' if match == MATCH_CAP else ''} {late}",
                      "first draft's confidence": f"{min(int(confidence[0] * 5), 4) / 5:.1f}-",
                      "drafting paid at the position before": {None: "first", True: "yes", False: "no"}[paid_before]}
            for signal, value in values.items():
                cell = groups[signal][value]
                cell[0] += 1
                cell[1] += gain > 0
                cell[2] += gain
            paid_before = gain > 0
    return {signal: {value: {"positions": c[0], "pays": c[1] / c[0], "gain_per_position": c[2] / c[0],
                             "gain": c[2]} for value, c in sorted(cells.items())}
            for signal, cells in groups.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=Path, required=True, help="a folder of simulate_backoff.py's records")
    parser.add_argument("--step-cost-from", type=Path,
                        default=Path("results/adaptive_length/size24_pair/eval_spec_bench_tasks_k7_greedy_w4a8_t2.json"),
                        help="a results JSON whose provenance settings hold the step costs of hspec:auto")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    settings_costs = json.loads(args.step_cost_from.read_text())["provenance"]["settings"]["step_costs"]
    cost = StepCost(**settings_costs["hspec:auto"])
    records = [json.loads(line) for name in ("eval", "dev") if (args.records / f"{name}.jsonl").exists()
               for line in (args.records / f"{name}.jsonl").read_text().splitlines()]
    if not records:
        raise SystemExit(f"no records in {args.records}; make them with scripts/simulate_backoff.py")
    tokenizer = load_target(None).tokenizer
    prompts = {item.id: tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}])
               for items in item_sets().values() for _, item in items}
    signals = tally(records, prompts, cost)
    lengths = [len(row["tokens"]) for row in records]
    limit = max(row.get("max_new_tokens", MAX_NEW_TOKENS) for row in records)
    answers = {"tokens_mean": sum(lengths) / len(lengths), "at_limit": sum(n >= limit for n in lengths),
               "limit": limit}
    settings = {"records": str(args.records), "items": len(records), "answers": answers, "K": K, "late_from": LATE,
                "step_cost": cost.to_dict(), "step_cost_from": str(args.step_cost_from)}
    command = (f"python scripts/backoff_signals.py --records {args.records} --step-cost-from {args.step_cost_from} "
               f"--out {args.out}")
    payload = {"provenance": provenance(command, settings), "signals": signals}
    lines = ["# Where drafting pays, by what is known before and after drafting\n",
             provenance_markdown(payload["provenance"]),
             f"\nThe {len(records)} recorded answers: {answers['tokens_mean']:.1f} tokens on average, "
             f"{answers['at_limit']} stopped at the limit of {limit}.\n",
             f"Every output position of the {len(records)} recorded items (not only the anchors a decoding visits): "
             f"the share where H-Spec's drafts there pay (n >= 1 accepted and n + 1 tokens cost less than n + 1 "
             f"plain steps, by the settings' step costs) and the decodes that gains, per position. \"late\": "
             f"positions {LATE} and after.\n",
             "| signal | value | positions | pays | gain per position |", "|---|---|---:|---:|---:|"]
    for signal, cells in signals.items():
        for value, c in cells.items():
            lines.append(f"| {signal} | {value} | {c['positions']} | {c['pays']:.3f} | {c['gain_per_position']:.3f} |")
    json_path, md_path = write_results(args.out, "signals", payload, "\n".join(lines) + "\n")
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
