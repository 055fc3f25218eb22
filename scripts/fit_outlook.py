"""Fit a drafter's outlook (`hspec.drafters.outlook`) on recorded decoding, and replay `KIND:auto` with it.

The records are `scripts/simulate_backoff.py`'s (one greedy answer per Spec-Bench item with the drafter's K drafts
at every output position; `dev`: items outside `hspec eval`'s, `eval`: its 24 a task). At each position the features
are the target's hidden states at the last committed token, at the drafter's target layers, as decoding hands them
to `commit` (the prompt's prefill, then the answer's tokens in one call of the target's decode path, with autograd
off as in decoding: on SmolLM2 in w4a8 the same calls with it on take other products and differ in the last
layers; equal to decoding's bits, tests/test_outlook.py), cached beside the records; the label is how many of the
K drafts there the target accepted.

The outlook is fitted on `dev` only (or, `--fit-on dev,more`, on `dev` and the other 200 Spec-Bench items outside
`eval`, recorded here first): the L2 weight is chosen by two-fold cross-validation over those items (every other
one in a fold), by the replay's predicted speed over all tasks on the held-out fold with the first
`--step-cost-from` costs, then the outlook is refitted on all of them. Shown on both sets, each cost set, over the
whole answers and over their first 128 positions (`hspec eval`'s answers): the replay's predicted speed over plain
decoding per task for the back-off alone (the default `Backoff`) and with the outlook deciding, the oracle's bound,
the outlook's AUC per draft position and its calibration (mean S_k against the share accepting at least k). The
replay is checked against the real `KIND:auto` with the fitted outlook on the first `eval` item of each task (the
same draft lengths at every step).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/fit_outlook.py [--records runs/backoff_sim_512]
        [--drafter hspec] [--drafter-path DIR] [--step-cost-from A.json,B.json]
        [--step-cost DRAFT,PER_TOKEN,PER_TOKEN_KEY[,...]] [--head FILE] [--out results/adaptive_length/outlook]

For a drafter of your own: records first (`scripts/simulate_backoff.py --drafter-path DIR --max-new-tokens 512
--records runs/my_records --step-cost C`, C this machine's costs, which `hspec generate --drafter KIND:auto`
prints), then this with the same `--drafter-path`, `--records` and `--step-cost`; the outlook lands in DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from simulate_backoff import MAX_NEW_TOKENS, TASKS, K, accepted_at, check, item_sets, oracle, record, replay, speeds  # noqa: E402, E501

from hspec.data.tasks import load_task  # noqa: E402
from hspec.drafters.cost_aware import Backoff  # noqa: E402
from hspec.drafters.outlook import OUTLOOK_FILE, Outlook, fit_outlook  # noqa: E402
from hspec.drafters.step_cost import StepCost  # noqa: E402
from hspec.models.loading import load_target  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402
from hspec.runtime import build_drafter, shipped_drafter_path  # noqa: E402

SETS = ("dev", "more", "eval")  # "more": recorded here when fitted on (`more_items`)
L2_GRID = (0.03, 0.1, 0.3, 1.0)
SHORT = 128  # `hspec eval`'s answers: the replay also over each answer's first SHORT positions
COSTS = ("results/adaptive_length/size24_pair/eval_spec_bench_tasks_k7_greedy_w4a8_t2.json",
         "results/adaptive_length/zen1/eval_spec_bench_tasks_k7_greedy_w4a8_t2.json")


def more_items() -> list[tuple[str, object]]:
    """Spec-Bench items of the five tasks in neither `eval` nor `dev` (simulate_backoff.item_sets): 40 a task."""
    taken = {item.id for chosen in item_sets().values() for _, item in chosen}
    return [(task, item) for task in TASKS for item in load_task(task).items if item.id not in taken]


def prompt_of(target, item_id: str, items: dict) -> list[int]:
    return target.tokenizer.encode_chat([{"role": "user", "content": items[item_id].turns[0]}])


@torch.no_grad()
def features_of(target, layers: tuple[int, ...], prompt: list[int], row: dict) -> torch.Tensor:
    """(positions, len(layers) x H) float32: at output position p, the hidden states of the last committed
    token (the prompt's last for p = 0, else answer token p - 1), as decoding commits them."""
    model, n = target.model, len(row["steps"])
    pool = model.new_pool(num_pages=(len(prompt) + n) // 64 + 2, page_size=64)
    pool.add_sequence(0)
    first = model.prefill(torch.tensor([prompt]), pool, [0], layers, last_logits_only=True).hidden[0, -1:]
    rest = (model(torch.tensor([row["tokens"][:n - 1]]), pool, [0], layers, last_logits_only=True).hidden[0]
            if n > 1 else first[:0])
    return torch.cat([first, rest]).float().flatten(1)


def load_features(target, layers: tuple[int, ...], rows: list[dict], prompts: dict[str, list[int]],
                  path: Path) -> list[torch.Tensor]:
    """Each row's features, from `path` where computed before (same items, layers and dtype)."""
    key = {"items": [row["item"] for row in rows], "layers": list(layers), "dtype": target.model.dtype_name}
    if path.exists():
        saved = torch.load(path)
        if saved["key"] == key:
            return saved["features"]
    out = []
    for number, row in enumerate(rows, 1):
        out.append(features_of(target, layers, prompts[row["item"]], row))
        print(f"features {path.stem} {number}/{len(rows)}", flush=True)
    torch.save({"key": key, "features": out}, path)
    return out


def step_costs_in(path: Path, drafter: str) -> StepCost:
    """DRAFTER:auto's step costs in a results JSON's provenance settings."""
    return StepCost(**json.loads(path.read_text())["provenance"]["settings"]["step_costs"][f"{drafter}:auto"])


def labels_of(row: dict) -> torch.Tensor:
    return torch.tensor([accepted_at(row, position, K) for position in range(len(row["steps"]))])


def truncated(row: dict, positions: int) -> dict:
    return {**row, "steps": row["steps"][:positions]}


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """The chance a random positive scores above a random negative (ties half), by ranks."""
    order = score.argsort()
    ranks = torch.empty_like(score, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    positive = label.bool()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def rules(rows: list[dict], estimates: dict[str, list[list[float]]], cost: StepCost, horizon: int | None
          ) -> dict[str, dict[str, float]]:
    """Predicted speeds of the back-off alone, with the outlook, and the oracle, over each answer's first
    `horizon` positions (None: all)."""
    cut = [row if horizon is None else truncated(row, horizon) for row in rows]
    return {"backoff": speeds(cut, lambda row: replay(row, cost, Backoff())[0]),
            "outlook": speeds(cut, lambda row: replay(row, cost, Backoff(), outlook=estimates[row["item"]])[0]),
            "oracle": speeds(cut, lambda row: oracle(row, cost))}


def estimates_of(outlook: Outlook, rows: list[dict], features: list[torch.Tensor]) -> dict[str, list[list[float]]]:
    return {row["item"]: [outlook.estimates(h) for h in f] for row, f in zip(rows, features)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=Path, default=Path("runs/backoff_sim_512"),
                        help="a folder of simulate_backoff.py's records (dev.jsonl, eval.jsonl)")
    parser.add_argument("--drafter", default="hspec", help="the trained kind the records were made with")
    parser.add_argument("--drafter-path", type=Path, default=None,
                        help="the checkpoint the records were made with (simulate_backoff.py's --drafter-path; "
                        "default: the shipped one)")
    parser.add_argument("--dtype", default="w4a8", help="the target's dtype (the records')")
    parser.add_argument("--step-cost-from", default=",".join(COSTS),
                        help="comma-separated results JSONs whose provenance settings hold DRAFTER:auto's step costs; "
                        "the first chooses the L2 weight, every one is replayed")
    parser.add_argument("--step-cost", default=None,
                        help="the costs themselves, in 1-token decodes (`hspec generate --step-cost`'s form); "
                        "overrides --step-cost-from")
    parser.add_argument("--head", type=Path, default=None,
                        help=f"where the fitted outlook goes (default: {OUTLOOK_FILE} in the drafter's folder, "
                        "where `KIND:auto` reads it)")
    parser.add_argument("--fit-on", choices=("dev", "dev,more"), default="dev",
                        help="the records fitted on: dev (default), or dev and 200 more Spec-Bench items outside eval "
                        "(recorded here into RECORDS/more.jsonl first, resumably: ~1 h at one thread)")
    parser.add_argument("--out", type=Path, default=Path("results/adaptive_length/outlook"))
    args = parser.parse_args()
    if args.step_cost is not None:
        try:
            costs = {"--step-cost": StepCost.parse(args.step_cost)}
        except ValueError as error:
            parser.error(str(error))
    else:
        cost_files = [Path(p) for p in args.step_cost_from.split(",")]
        for path in cost_files:
            if not path.exists():
                parser.error(f"--step-cost-from: no file {path}")
        costs = {str(path): step_costs_in(path, args.drafter) for path in cost_files}
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    target = load_target(None, dtype=args.dtype)
    layers = tuple(build_drafter(args.drafter, target, args.drafter_path).target_layers)
    fit_on = args.fit_on.split(",")
    sets = [name for name in SETS if name in ("dev", "eval", *fit_on)]
    items = {item.id: item for chosen in (*item_sets().values(), more_items()) for _, item in chosen}
    rows = {name: [json.loads(line) for line in (args.records / f"{name}.jsonl").read_text().splitlines()]
            for name in ("dev", "eval")}
    if "more" in fit_on:  # recorded at the records' length, resuming where a run stopped
        length = max(row.get("max_new_tokens", MAX_NEW_TOKENS) for row in rows["eval"])
        rows["more"] = record(target, args.drafter, more_items(), args.records / "more.jsonl", length,
                              args.drafter_path)
    prompts = {row["item"]: prompt_of(target, row["item"], items) for name in sets for row in rows[name]}
    features = {name: load_features(target, layers, rows[name], prompts, args.records / f"outlook_features_{name}.pt")
                for name in sets}
    labels = {name: [labels_of(row) for row in rows[name]] for name in sets}

    fit_rows = [row for name in fit_on for row in rows[name]]
    fit_features = [f for name in fit_on for f in features[name]]
    fit_labels = [y for name in fit_on for y in labels[name]]
    first_cost = next(iter(costs.values()))
    halves = (range(0, len(fit_rows), 2), range(1, len(fit_rows), 2))
    choice = {}
    for l2 in L2_GRID:  # two-fold: fitted on each half of the items, replayed on the other, the speeds averaged
        held_speeds = []
        for fitted, held in (halves, halves[::-1]):
            half = fit_outlook(torch.cat([fit_features[i] for i in fitted]), torch.cat([fit_labels[i] for i in fitted]),
                               K, layers, l2)
            held_rows = [fit_rows[i] for i in held]
            estimates = estimates_of(half, held_rows, [fit_features[i] for i in held])
            held_speeds.append(rules(held_rows, estimates, first_cost, None)["outlook"]["all"])
        choice[l2] = sum(held_speeds) / len(held_speeds)
        print(f"l2 {l2}: predicted speed on the held-out halves {choice[l2]:.3f}", flush=True)
    l2 = max(choice, key=choice.get)
    outlook = fit_outlook(torch.cat(fit_features), torch.cat(fit_labels), K, layers, l2)
    estimates = {name: estimates_of(outlook, rows[name], features[name]) for name in sets}

    quality = {}
    for name in sets:
        survival = torch.tensor([outlook.survival(h) for f in features[name] for h in f])  # (N, K)
        accepted = torch.cat(labels[name])
        quality[name] = [{"k": k, "auc": auc(survival[:, k - 1], accepted >= k),
                          "mean_S": float(survival[:, k - 1].mean()), "share": float((accepted >= k).float().mean())}
                         for k in range(1, K + 1)]
    replays = {str(path): {name: {str(horizon or "all"): rules(rows[name], estimates[name], cost, horizon)
                                  for horizon in (None, SHORT)} for name in sets}
               for path, cost in costs.items()}
    max_new_tokens = max(row.get("max_new_tokens", SHORT) for row in rows["eval"])
    checked = check(target, args.drafter, rows["eval"], first_cost, max_new_tokens, args.drafter_path, outlook,
                    estimates["eval"])

    head = args.head or (args.drafter_path or shipped_drafter_path(args.drafter, target.name)) / OUTLOOK_FILE
    fitted_on = " + ".join(f"{len(rows[name])} {name} items" for name in fit_on)
    about = {"records": str(args.records), "fitted_on": fitted_on, "l2": l2, "dtype": args.dtype, "K": K}
    shown = head.resolve().relative_to(Path.cwd()) if head.resolve().is_relative_to(Path.cwd()) else head
    command = (f"python scripts/fit_outlook.py --records {args.records} --drafter {args.drafter} "
               + (f"--drafter-path {args.drafter_path} " if args.drafter_path else "") + f"--dtype {args.dtype} "
               + (f"--step-cost {args.step_cost} " if args.step_cost else f"--step-cost-from {args.step_cost_from} ")
               + f"--fit-on {args.fit_on} --head {shown} --out {args.out}")
    settings = {**about, "drafter": args.drafter, "layers": list(layers), "l2_grid": list(L2_GRID), "l2_choice": choice,
                "fit_on": fit_on, "positions": {name: sum(len(x) for x in labels[name]) for name in sets},
                "items": {name: len(rows[name]) for name in sets}, "short_horizon": SHORT,
                "step_costs": {str(path): cost.to_dict() for path, cost in costs.items()}, "head": str(shown),
                "threads": torch.get_num_threads()}
    # The tree this ran from, read before the head replaces a tracked file.
    payload = {"provenance": provenance(command, settings), "check": checked, "quality": quality, "replays": replays}
    outlook.save(head, about)
    json_path, md_path = write_results(args.out, "outlook", payload, markdown(payload))
    print(f"wrote {head}, {json_path} and {md_path}")
    return 0


def markdown(payload: dict) -> str:
    settings = payload["provenance"]["settings"]
    lines = [f"# `{settings['drafter']}:auto` with an outlook: whether to draft, judged before drafting\n",
             provenance_markdown(payload["provenance"]),
             f"\nThe outlook (`hspec.drafters.outlook`): S_k ~ P(at least k of the K = {K} drafts accepted), one "
             f"logistic regression per k over the target's hidden states at the last committed token (layers "
             f"{settings['layers']}), fitted on the "
             f"{sum(settings['positions'][name] for name in settings.get('fit_on', ['dev']))} positions of "
             f"{settings['fitted_on']}; L2 weight {settings['l2']} (chosen by two-fold cross-validation on them: "
             + ", ".join(f"{k}: {v:.3f}" for k, v in settings["l2_choice"].items()) + ").\n",
             "Replay checked against the real `:auto` with this outlook (the same drafts verified at every step): "
             + ", ".join(f"{c['item']} ({c['steps']} steps) {'same' if c['same_lengths'] else 'DIFFERENT'}"
                         for c in payload["check"]) + "\n",
             "## How well it predicts (AUC of S_k for [accepted >= k]; mean S_k against the share)\n",
             "| set | " + " | ".join(f"k = {k}" for k in range(1, K + 1)) + " |", "|---|" + "---|" * K]
    for name, rows in payload["quality"].items():
        lines.append(f"| {name} AUC | " + " | ".join(f"{r['auc']:.3f}" for r in rows) + " |")
        lines.append(f"| {name} mean S / share | "
                     + " | ".join(f"{r['mean_S']:.3f} / {r['share']:.3f}" for r in rows) + " |")
    lines += ["\n## Predicted speed over plain decoding\n",
              "Each step charged its step cost in decodes (the file's costs for `hspec:auto`); `backoff`: the default "
              "back-off alone (what `:auto` did before), `outlook`: the outlook deciding whether a step drafts, "
              "`oracle`: knowing the verdicts. Horizon: the whole answers, or their first 128 positions.\n",
              "| step costs | set | horizon | rule | " + " | ".join(TASKS) + " | all | worst |",
              "|---|---|---|---|" + "---|" * (len(TASKS) + 2)]
    for path, by_set in payload["replays"].items():
        for name, by_horizon in by_set.items():
            for horizon, by_rule in by_horizon.items():
                for rule, s in by_rule.items():
                    label = Path(path).parent.name if path.endswith(".json") else "given"
                    lines.append(f"| {label} | {name} | {horizon} | {rule} | "
                                 + " | ".join(f"{s[t]:.3f}" for t in TASKS)
                                 + f" | {s['all']:.3f} | {min(s[t] for t in TASKS):.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
