"""Which back-off should `KIND:auto` use? The rule replayed offline on recorded proposals, for many back-offs.

A trained drafter's proposal at an output position depends only on the committed prefix (the kernels are
row-invariant; H-Spec reads the target's last hidden state and its KV pool), and greedy output does not depend
on the drafts. So one plain greedy run per item that proposes K drafts at every position and verifies none
records all that `KIND:auto`'s rule reads: each position's drafts, their confidences and its context length,
and the output. A back-off is then replayed step by step with the rule's own `RowState` (`takes_turn`,
`choose`, `record`), each step charged the cost model's `StepCost.of`; the predicted speed over plain decoding
is the output's length over the steps' summed costs (in decodes, a plain step costing 1).

The replay is checked against the real thing: on the first item of each task, `KIND:auto` with the same costs
must draft exactly the lengths the replay does, step by step (the `check` rows of the results).

Two sets of Spec-Bench items: `eval`, the 24 a task `hspec eval --size 24` runs, and `dev`, 16 a task from the
other items (every third); a back-off is chosen on `dev` by its worst task, and shown on both.

    .venv/bin/python scripts/simulate_backoff.py [--drafter hspec] [--dtype w4a8]
        [--step-cost-from results/adaptive_length/size24_pair/eval_spec_bench_tasks_k7_greedy_w4a8_t2.json]
        [--max-new-tokens 128] [--records runs/backoff_sim] [--out results/adaptive_length/backoff_sim]
        [--drafter-path DIR]
        [--charge-from results/adaptive_length/size24/fit_step_costs.json]

`--charge-from` charges each step what `scripts/fit_step_costs.py`'s joint fit of an evaluation found a step
costs inside real runs (its surcharge on every step, first-token, per-token and draft costs) while the rule still
decides by the measured costs, as the real `:auto` does, and the oracle knows the charged costs; the results then
go beside that fit (`fit_step_costs.json`'s folder), as `backoff_sim_charged`.

Records go to <records>/<set>.jsonl (kept between runs: an item recorded is not recorded again); the results to
<out>/backoff_sim.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from hspec.data.tasks import load_task  # noqa: E402
from hspec.decoding.generate import SpeculativeDecoder  # noqa: E402
from hspec.drafters.base import DraftBatch, Proposal  # noqa: E402
from hspec.drafters.cost_aware import Backoff, CostAwareDrafter, RowState, outlook_length  # noqa: E402
from hspec.drafters.outlook import Outlook  # noqa: E402
from hspec.drafters.step_cost import StepCost  # noqa: E402
from hspec.drafters.wrapping import WrappingDrafter  # noqa: E402
from hspec.models.loading import load_target  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402
from hspec.runtime import build_drafter  # noqa: E402
from hspec.sampling import SamplingParams  # noqa: E402

TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")
K = 7
MAX_NEW_TOKENS = 128
GRID = {"first": (1, 2, 4, 8, 16), "growth": (2, 4, 6, 8), "most": (32, 64, 128), "cold": (0, 32, 64, 128)}
SHOWN = 10  # back-offs in the table besides the default and the earlier ones
# Earlier defaults, marked in the table: before the cold rule (`Backoff.cold`) and the first one.
EARLIER = {"before cold": {"first": 2, "growth": 6, "most": 128, "cold": 0},
           "old": {"first": 1, "growth": 2, "most": 32, "cold": 0}}


class Recorder(WrappingDrafter):
    """Proposes K drafts at every step and verifies none, keeping (context length, drafts, confidences)."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.steps: list[tuple[int, list[int], list[float]]] = []

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        proposal = self.model.propose(batch, K)
        self.steps.append((batch.pool.lengths(batch.seq_ids)[0], proposal.draft_tokens[0].tolist(),
                           proposal.confidence[0].float().tolist()))
        return Proposal(proposal.draft_tokens, proposal.draft_probs, torch.zeros(1, dtype=torch.long))


def item_sets() -> dict[str, list[tuple[str, object]]]:
    sets: dict[str, list[tuple[str, object]]] = {"eval": [], "dev": []}
    for task in TASKS:
        evaluated = load_task(task, 24).items
        ids = {item.id for item in evaluated}
        sets["eval"] += [(task, item) for item in evaluated]
        sets["dev"] += [(task, item) for item in load_task(task).items if item.id not in ids][::3][:16]
    return sets


def record(target, drafter_kind: str, items, path: Path, max_new_tokens: int = MAX_NEW_TOKENS,
           drafter_path: Path | None = None) -> list[dict]:
    """Each item's output (at most `max_new_tokens`) and per-position proposals, from `path` where recorded before
    (rows without a `max_new_tokens` field were recorded at the default, `MAX_NEW_TOKENS`)."""
    done = {row["item"]: row for row in map(json.loads, path.read_text().splitlines())} if path.exists() else {}
    other = {row.get("max_new_tokens", MAX_NEW_TOKENS) for row in done.values()} - {max_new_tokens}
    if other:
        raise SystemExit(f"{path} holds records of at most {sorted(other)} new tokens, not {max_new_tokens}: "
                         "give --records a folder of its own for each length")
    recorder = Recorder(build_drafter(drafter_kind, target, drafter_path))
    decoder = SpeculativeDecoder(target.model, recorder, K, target.tokenizer.eos_token_ids)
    rows = []
    for number, (task, item) in enumerate(items, 1):
        if item.id not in done:
            prompt = target.tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}])
            recorder.steps = []
            output = decoder.generate([prompt], SamplingParams(), max_new_tokens).sequences[0]
            done[item.id] = {"task": task, "item": item.id, "max_new_tokens": max_new_tokens,
                             "tokens": output.token_ids, "steps": recorder.steps}
            with path.open("a") as f:
                f.write(json.dumps(done[item.id]) + "\n")
            print(f"recorded {path.stem} {number}/{len(items)} {item.id}", flush=True)
        rows.append(done[item.id])
    return rows


def accepted_at(row: dict, position: int, n: int) -> int:
    """How many of the first n drafts recorded at `position` the target accepts: those that match the output
    after the anchor (within the recorded steps, as decoding stops there)."""
    tokens, steps = row["tokens"], row["steps"]
    drafts, ahead = steps[position][1], tokens[position + 1: len(steps)]
    accepted = 0
    while accepted < min(n, len(ahead)) and drafts[accepted] == ahead[accepted]:
        accepted += 1
    return accepted


def charged_from(path: Path) -> tuple[StepCost, float]:
    """The costs and the surcharge a step (1-token decodes) of `scripts/fit_step_costs.py`'s joint fit in `path`."""
    joint = json.loads(path.read_text()).get("joint")
    if joint is None:
        raise SystemExit(f"{path} holds no joint fit; make it with scripts/fit_step_costs.py")
    return StepCost(draft=joint["draft"], per_token=joint["per_token"], per_token_key=0.0,
                    first_token=joint["first_token"], draft_per_key=0.0), joint["tax"]


def replay(row: dict, cost: StepCost, backoff: Backoff, charge: StepCost | None = None, tax: float = 0.0,
           outlook: list[list[float]] | None = None, margin: float = 1.0) -> tuple[float, list[int]]:
    """The rule on one recorded item: its steps' summed cost (decodes) and drafts verified per step. The rule
    decides by `cost`; each step is charged by `charge` (default `cost`) plus `tax`. `outlook`: per output
    position an outlook's a_1..a_K (`Outlook.estimates`), which then decides whether a step drafts instead of
    the back-off, as in `CostAwareDrafter` with an outlook of that `margin`."""
    steps = row["steps"]
    state, position, total, lengths = RowState(), 0, 0.0, []
    while position < len(steps):
        keys, _, confidence = steps[position]
        if outlook is None:
            drafted = K if state.takes_turn() else 0
        else:
            drafted = outlook_length(outlook[position], keys, cost, margin)
            drafted = drafted if drafted == 0 or cost.draft_per_position > 0 else K
        state.pending = None
        n = state.choose(confidence[:drafted], keys, cost, backoff, positions=drafted) if drafted else 0
        accepted = accepted_at(row, position, n)
        state.record(accepted)
        total += (charge or cost).of(n, keys, drafted) + tax
        lengths.append(n)
        position += accepted + 1
    return total, lengths


def oracle(row: dict, cost: StepCost, tax: float = 0.0) -> float:
    """What no rule can beat by much: each step knows how many drafts the target will accept, runs the drafter
    only where verifying exactly those pays against a plain step, and verifies them (summed cost, decodes)."""
    steps = row["steps"]
    position, total = 0, 0.0
    while position < len(steps):
        keys = steps[position][0]
        accepted = accepted_at(row, position, K)
        if accepted and accepted + 1 > cost.of(accepted, keys, accepted):
            total += cost.of(accepted, keys, accepted) + tax
            position += accepted + 1
        else:
            total += 1.0 + tax
            position += 1
    return total


def speeds(rows: list[dict], cost_of) -> dict[str, float]:
    """Predicted speed over plain decoding per task and over all: plain steps over the steps' summed costs,
    `cost_of(row)` the summed cost of one item's steps."""
    out = {}
    for task in (*TASKS, "all"):
        chosen = [row for row in rows if task in ("all", row["task"])]
        out[task] = sum(len(row["steps"]) for row in chosen) / sum(cost_of(row) for row in chosen)
    return out


def check(target, drafter_kind: str, rows: list[dict], cost: StepCost, max_new_tokens: int = MAX_NEW_TOKENS,
          drafter_path: Path | None = None, outlook: Outlook | None = None,
          estimates: dict[str, list[list[float]]] | None = None) -> list[dict]:
    """The first recorded item of each task drafted by the real `KIND:auto`, with the back-off alone or (`outlook`,
    and its `estimates` per item and position) with an outlook: the same lengths as the replay?"""
    auto = build_drafter(f"{drafter_kind}:auto", target, drafter_path, step_cost=cost)
    drafter = CostAwareDrafter(auto.model, auto.vocab_size, cost, outlook=outlook)
    decoder = SpeculativeDecoder(target.model, drafter, K, target.tokenizer.eos_token_ids)
    out = []
    for task in TASKS:
        row = next(row for row in rows if row["task"] == task)
        item = next(item for item in load_task(task, 24).items if item.id == row["item"])
        prompt = target.tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}])
        real = decoder.generate([prompt], SamplingParams(), max_new_tokens).sequences[0].num_drafted
        replayed = replay(row, cost, Backoff(), outlook=None if outlook is None else estimates[row["item"]])[1]
        out.append({"item": row["item"], "steps": len(real), "same_lengths": list(real) == replayed})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", default="hspec", help="a trained kind with confidences (default hspec)")
    parser.add_argument("--drafter-path", type=Path, default=None,
                        help="a checkpoint of DRAFTER (default: the shipped one)")
    parser.add_argument("--dtype", default="w4a8")
    parser.add_argument("--step-cost-from", type=Path,
                        default=Path("results/adaptive_length/size24_pair/eval_spec_bench_tasks_k7_greedy_w4a8_t2.json"),
                        help="a results JSON whose provenance settings hold the step costs of DRAFTER:auto")
    parser.add_argument("--step-cost", type=StepCost.parse, help="the costs themselves (`--step-cost` form); "
                        "overrides --step-cost-from")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                        help=f"the most tokens an answer gets (default {MAX_NEW_TOKENS}; records of another length "
                        "need a --records folder of their own)")
    parser.add_argument("--records", type=Path, default=Path("runs/backoff_sim"))
    parser.add_argument("--out", type=Path, default=Path("results/adaptive_length/backoff_sim"))
    parser.add_argument("--charge-from", type=Path, default=None,
                        help="a fit_step_costs.json whose joint fit each step is charged by (module docstring)")
    args = parser.parse_args()
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    charge, tax = (None, 0.0) if args.charge_from is None else charged_from(args.charge_from)
    cost = args.step_cost
    if cost is None:
        given = json.loads(args.step_cost_from.read_text())["provenance"]["settings"]["step_costs"]
        cost = StepCost(**given[f"{args.drafter}:auto"])
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    target = load_target(None, dtype=args.dtype)
    args.records.mkdir(parents=True, exist_ok=True)
    rows = {name: record(target, args.drafter, items, args.records / f"{name}.jsonl", args.max_new_tokens,
                         args.drafter_path)
            for name, items in item_sets().items()}
    checked = check(target, args.drafter, rows["eval"], cost, args.max_new_tokens, args.drafter_path)
    results = []
    for first, growth, most, cold in itertools.product(*GRID.values()):
        if first <= most:
            backoff = Backoff(first, growth, most, cold)
            results.append({"backoff": vars(backoff),
                            **{name: speeds(r, lambda row, b=backoff: replay(row, cost, b, charge, tax)[0])
                               for name, r in rows.items()}})
    results.sort(key=lambda r: (-min(r["dev"][task] for task in TASKS), -r["dev"]["all"]))
    bound = {name: speeds(r, lambda row: oracle(row, charge or cost, tax)) for name, r in rows.items()}
    settings = {"drafter": args.drafter, "dtype": args.dtype, "K": K, "max_new_tokens": args.max_new_tokens,
                "step_cost": cost.to_dict(), "items": {name: len(r) for name, r in rows.items()},
                "grid": GRID, "threads": torch.get_num_threads(),
                **({} if charge is None else {"charged": {**charge.to_dict(), "tax": tax},
                                              "charged_from": str(args.charge_from)})}
    command = (f"python scripts/simulate_backoff.py --drafter {args.drafter} --dtype {args.dtype} "
               + (f"--step-cost {args.step_cost}" if args.step_cost else f"--step-cost-from {args.step_cost_from}"))
    if args.charge_from is not None:
        command += f" --charge-from {args.charge_from}"
    if args.max_new_tokens != MAX_NEW_TOKENS:
        command += f" --max-new-tokens {args.max_new_tokens} --records {args.records} --out {args.out}"
    if args.drafter_path is not None:
        command += f" --drafter-path {args.drafter_path}"
    payload = {"provenance": provenance(command, settings), "check": checked, "results": results, "oracle": bound}
    out, stem = (args.out, "backoff_sim") if charge is None else (args.charge_from.parent, "backoff_sim_charged")
    json_path, md_path = write_results(out, stem, payload, markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


def markdown(payload: dict) -> str:
    settings = payload["provenance"]["settings"]
    default = vars(Backoff())
    shown = payload["results"][:SHOWN]
    shown += [r for r in payload["results"] if r["backoff"] in (default, *EARLIER.values()) and r not in shown]
    lines = [f"# `{settings['drafter']}:auto`'s back-off replayed on recorded proposals\n",
             provenance_markdown(payload["provenance"]),
             "\nPredicted speed over plain decoding (plain steps over the replayed steps' costs in decodes, "
             f"greedy, K = {K}, at most {settings['max_new_tokens']} new tokens; the costs: settings' step_cost, "
             "and where the settings name `charged`, each step charged those and their surcharge `tax` instead). "
             "A back-off: while none of a row's drafting has paid yet, skip `cold` steps each time drafting does "
             "not pay (0: no such rule); after, skip `first` steps after drafting did not pay, `growth` times the "
             "last skip after each further time, at most `most`. Sorted by the worst task on `dev`; the default "
             "and the earlier ones ("
             + "; ".join(f"{name}: {', '.join(map(str, b.values()))}" for name, b in EARLIER.items())
             + ") are marked.\n",
             "Replay checked against the real `:auto` run (the same drafts verified at every step): "
             + ", ".join(f"{c['item']} ({c['steps']} steps) {'same' if c['same_lengths'] else 'DIFFERENT'}"
                         for c in payload["check"]) + "\n",
             "| first | growth | most | cold | set | " + " | ".join(TASKS) + " | all | worst |",
             "|---|---|---|---|---|" + "---|" * (len(TASKS) + 2)]
    for r in shown:
        b = r["backoff"]
        mark = " (default)" if b == default else next((f" ({n})" for n, e in EARLIER.items() if b == e), "")
        for name in ("dev", "eval"):
            s = r[name]
            lines.append(f"| {b['first']}{mark} | {b['growth']} | {b['most']} | {b['cold']} | {name} | "
                         + " | ".join(f"{s[t]:.3f}" for t in TASKS)
                         + f" | {s['all']:.3f} | {min(s[t] for t in TASKS):.3f} |")
    for name, s in payload["oracle"].items():
        lines.append(f"| oracle | | | | {name} | " + " | ".join(f"{s[t]:.3f}" for t in TASKS)
                     + f" | {s['all']:.3f} | {min(s[t] for t in TASKS):.3f} |")
    lines.append("\nThe oracle knows, at every step, how many drafts the target will accept: it runs the drafter only "
                 "where verifying exactly those pays against a plain step (`oracle`). What separates a rule from it "
                 "is knowing, before paying for a draft, whether the first draft will be accepted.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
