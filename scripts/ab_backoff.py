"""Two rules of `hspec:auto` (back-offs, step costs) measured against plain decoding in one process, item by item.

`scripts/simulate_backoff.py` chooses the back-off on modelled step costs; this measures it. One H-Spec drafter (the
shipped one) sits behind two `CostAwareDrafter`s: "default", with this machine's step costs (measured once and
cached), the default `Backoff` and the drafter's outlook where it ships one (`hspec.drafters.outlook`); "other",
with another back-off (`--other`, default the old 1,2,32 without the cold rule), no outlook unless `--other-outlook
shipped`, and the same costs unless `--other-cost` gives others (e.g. those an earlier way of measuring them found).
`--other 2,6,128,128` (the default back-off) measures the outlook alone. Per item plain decoding and both run in
turn (the order reversed every other item), every output checked equal to plain's; speed is decode-phase tokens per
second over plain's, per task.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/ab_backoff.py [--size 24] [--other 1,2,32,0]
        [--other-outlook none|shipped]
        [--other-cost DRAFT,PER_TOKEN,PER_TOKEN_KEY[,FIRST_TOKEN[,DRAFT_PER_KEY[,DRAFT_PER_POSITION]]]]
        [--out results/adaptive_length/backoff_ab]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

from hspec.bench.draft_breakdown import _load_average  # noqa: E402
from hspec.data.tasks import load_task  # noqa: E402
from hspec.decoding.generate import SpeculativeDecoder  # noqa: E402
from hspec.drafters.cost_aware import Backoff, CostAwareDrafter  # noqa: E402
from hspec.drafters.step_cost import FORM, StepCost  # noqa: E402
from hspec.models.loading import load_target  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402
from hspec.runtime import build_drafter  # noqa: E402
from hspec.sampling import SamplingParams  # noqa: E402

TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=24, help="items a task (hspec eval's --size)")
    parser.add_argument("--other", default="1,2,32,0", help="FIRST,GROWTH,MOST[,COLD] of the back-off compared "
                        "(`Backoff`; COLD defaults to the default back-off's)")
    parser.add_argument("--other-cost", default=None, help="the other rule's step costs in 1-token decodes, "
                        f"{FORM} (default: the default rule's)")
    parser.add_argument("--other-outlook", choices=("none", "shipped"), default="none",
                        help="whether the other rule reads the drafter's shipped outlook too (default none)")
    parser.add_argument("--dtype", default="w4a8")
    parser.add_argument("--out", type=Path, default=Path("results/adaptive_length/backoff_ab"))
    args = parser.parse_args()
    try:
        other = Backoff(*(int(x) for x in args.other.split(",")))
    except (TypeError, ValueError) as error:
        parser.error(f"--other takes FIRST,GROWTH,MOST[,COLD], three or four integers, got {args.other!r} ({error})")
    try:
        other_cost = None if args.other_cost is None else StepCost.parse(args.other_cost, "--other-cost")
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    target = load_target(None, dtype=args.dtype)
    auto = build_drafter("hspec:auto", target)
    methods = {"plain": build_drafter("none", target),
               "default": CostAwareDrafter(auto.model, auto.vocab_size, auto.cost, Backoff(), auto.outlook),
               "other": CostAwareDrafter(auto.model, auto.vocab_size, other_cost or auto.cost, other,
                                         auto.outlook if args.other_outlook == "shipped" else None)}
    decoders = {name: SpeculativeDecoder(target.model, d, 7, target.tokenizer.eos_token_ids)
                for name, d in methods.items()}
    greedy = SamplingParams()
    warm = target.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    for decoder in decoders.values():
        decoder.generate([warm], greedy, 16)
    rows = []
    for task in TASKS:
        seconds, tokens = dict.fromkeys(methods, 0.0), dict.fromkeys(methods, 0)
        for number, item in enumerate(load_task(task, args.size).items):
            prompt = target.tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}])
            outputs = {}
            for name in list(decoders) if number % 2 == 0 else list(decoders)[::-1]:
                outputs[name] = decoders[name].generate([prompt], greedy, 128)
                seconds[name] += outputs[name].decode_s
                tokens[name] += outputs[name].num_new_tokens - 1
            plain = outputs["plain"].sequences[0].token_ids
            if any(out.sequences[0].token_ids != plain for out in outputs.values()):
                raise SystemExit(f"{item.id}: an output differs from plain decoding's")
        rate = {name: tokens[name] / seconds[name] for name in methods}
        rows.append({"task": task, "plain_tok_s": rate["plain"],
                     "default": rate["default"] / rate["plain"], "other": rate["other"] / rate["plain"]})
        print(rows[-1], flush=True)
    settings = {"dtype": args.dtype, "K": 7, "max_new_tokens": 128, "size_per_task": args.size,
                "default": vars(Backoff()), "other": vars(other), "step_cost": auto.cost.to_dict(),
                "default_outlook": auto.outlook is not None,
                "other_outlook": auto.outlook is not None and args.other_outlook == "shipped",
                "other_step_cost": (other_cost or auto.cost).to_dict(),
                "threads": torch.get_num_threads(), "load_average": _load_average()}
    command = (f"python scripts/ab_backoff.py --size {args.size} --other {args.other} "
               f"--other-outlook {args.other_outlook} --dtype {args.dtype}")
    if other_cost is not None:
        command += f" --other-cost {args.other_cost}"
    payload = {"provenance": provenance(command, settings), "results": rows}
    json_path, md_path = write_results(args.out, "ab_backoff", payload, markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


def _rule_words(backoff: dict, outlook: bool) -> str:
    """A rule in words: with an outlook, the outlook decides whether a row drafts; else its `Backoff`'s fields
    (results written before `Backoff.cold` have none: no cold rule; before the outlook, no outlook)."""
    if outlook:
        return "the drafter's outlook deciding whether a row drafts"
    cold = backoff.get("cold", 0)
    return (f"skip {backoff['first']}, x{backoff['growth']}, at most {backoff['most']}"
            + (f", {cold} while the row's drafting never paid" if cold else ", no cold rule"))


def _draft_words(cost: dict) -> str:
    """A draft's cost in words: by position where it grows with them (that rule drafts the outlook's length), else
    the whole block's (results written before `StepCost.draft_per_position` have none)."""
    per_position = cost.get("draft_per_position", 0.0)
    if per_position:
        return f"{cost['draft']:.3f} + {per_position:.3f} a position drafted"
    return f"{cost['draft']:.3f} whatever is drafted"


def markdown(payload: dict) -> str:
    settings = payload["provenance"]["settings"]
    d, o = settings["default"], settings["other"]
    costs = [settings["step_cost"], settings.get("other_step_cost", settings["step_cost"])]
    lines = ["# `hspec:auto` with two rules against plain decoding, one process\n",
             provenance_markdown(payload["provenance"]),
             f"\nDecode-phase speed over plain decoding, the same items interleaved (greedy, K <= 7, w4a8, every "
             f"output equal to plain's). default: {_rule_words(d, settings.get('default_outlook', False))}; other: "
             f"{_rule_words(o, settings.get('other_outlook', False))}. "
             "Step costs (1-token decodes): "
             + ("the same for both" if costs[0] == costs[1] else
                "; ".join(f"{name} draft {_draft_words(c)}, per token {c['per_token']:.3f}, first token "
                          f"{c['first_token']:.3f}" for name, c in zip(("default", "other"), costs))) + ".\n",
             "| task | plain (tok/s) | default | other |", "|---|---|---|---|"]
    for row in payload["results"]:
        lines.append(f"| {row['task']} | {row['plain_tok_s']:.1f} | {row['default']:.3f}x | {row['other']:.3f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
