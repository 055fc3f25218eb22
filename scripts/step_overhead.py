"""What a `:auto` drafter adds to a step that verifies nothing: the per-step surcharge on speculative runs.

`scripts/fit_step_costs.py`'s joint fit finds every step of a speculative run in `hspec eval` ~7-8% dearer than a
plain run's step, drafting or not. This measures the part that is the drafters' own work around a plain step: each
`KIND:auto` is given step costs so high that no draft ever pays (so every step verifies nothing: a plain decode,
plus the wrapper's rule, the lookup, the proposal's tensors and the commit; the model itself runs only on the
back-off's first probes, which the medians leave out), and its steps are timed in lockstep with plain decoding's:
the arms decode the same prompt on their own pools one step each in turn (the order reversed every step), so a
load that comes and goes weighs on all alike. Per prompt, each arm's median step less plain's median step; per
task and over all items, the medians of those.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/step_overhead.py [--items 4] [--steps 120]
        [--out results/adaptive_length/step_overhead]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

from hspec.bench.draft_breakdown import _load_average  # noqa: E402
from hspec.cache.paged_pool import pages_for  # noqa: E402
from hspec.data.tasks import load_task  # noqa: E402
from hspec.decoding.step import DecodeStages  # noqa: E402
from hspec.drafters.step_cost import StepCost  # noqa: E402
from hspec.models.loading import load_target  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402
from hspec.runtime import build_drafter  # noqa: E402
from hspec.sampling import SamplingBatch, SamplingParams, greedy_tokens  # noqa: E402

K = 7
ARMS = ("none", "ngram:auto", "hspec:auto", "hspec+ngram:auto")
TASKS = ("qa", "summarization", "rag")
UNPAID = StepCost(draft=50.0, per_token=50.0, per_token_key=0.0, first_token=50.0, draft_per_key=0.0)
SKIPPED = 8  # steps of each arm not timed (the first pages, the first calls)


def lockstep(target, drafters: dict, prompt: list[int], steps: int) -> dict[str, list[float]]:
    """Seconds of each arm's steps, decoding `prompt` one step of each arm in turn."""
    sampling = SamplingBatch.from_params([SamplingParams()])
    generators = [torch.Generator().manual_seed(0)]
    arms = {}
    for name, drafter in drafters.items():
        stages = DecodeStages(target.model, drafter, K, eos_token_ids=())
        pool = target.model.new_pool(pages_for(len(prompt) + steps * (K + 1) + K + 1, 16), 16,
                                     drafter.num_drafter_layers)
        history = list(prompt) + [int(greedy_tokens(stages.prefill(pool, 0, prompt))[0])]
        arms[name] = (stages, pool, history, [])
    try:
        for step in range(steps):
            for name in (list(arms) if step % 2 == 0 else list(arms)[::-1]):
                stages, pool, history, seconds = arms[name]
                start = time.perf_counter()
                result = stages.step(pool, [0], [history], sampling, generators)
                seconds.append(time.perf_counter() - start)
                if any(result.num_drafted):
                    raise RuntimeError(f"{name} verified drafts whose costs never pay")
                history.extend(result.new_tokens[0])
    finally:
        for stages, pool, _, _ in arms.values():
            stages.release(pool, 0)
    return {name: arm[3][SKIPPED:] for name, arm in arms.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=4, help="Spec-Bench items a task")
    parser.add_argument("--steps", type=int, default=120, help="steps each arm decodes per item")
    parser.add_argument("--out", type=Path, default=Path("results/adaptive_length/step_overhead"))
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    target = load_target(None, dtype="w4a8")
    drafters = {name: build_drafter(name, target, K=K, **({} if name == "none" else {"step_cost": UNPAID}))
                for name in ARMS}
    rows = []
    with torch.inference_mode():
        for task in TASKS:
            for item in load_task(task, args.items).items:
                prompt = target.tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}])
                medians = {name: statistics.median(s) for name, s in lockstep(target, drafters, prompt,
                                                                              args.steps).items()}
                rows.append({"task": task, "item": item.id, "prompt_tokens": len(prompt),
                             "plain_ms": 1000 * medians["none"],
                             "extra_ms": {n: 1000 * (medians[n] - medians["none"]) for n in ARMS[1:]}})
                print(rows[-1], flush=True)
    summary = {group: {n: statistics.median(r["extra_ms"][n] / r["plain_ms"] for r in rows
                                            if group in (r["task"], "all"))
                       for n in ARMS[1:]} for group in (*TASKS, "all")}
    settings = {"dtype": "w4a8", "K": K, "items_per_task": args.items, "steps": args.steps, "skipped": SKIPPED,
                "threads": torch.get_num_threads(), "load_average": _load_average()}
    command = f"python scripts/step_overhead.py --items {args.items} --steps {args.steps}"
    payload = {"provenance": provenance(command, settings), "rows": rows, "summary": summary}
    json_path, md_path = write_results(args.out, "step_overhead", payload, markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


def markdown(payload: dict) -> str:
    lines = ["# What a `:auto` drafter adds to a step that verifies nothing\n",
             provenance_markdown(payload["provenance"]),
             "\nw4a8 target, greedy; each `KIND:auto` with step costs no draft pays, timed in lockstep with plain "
             "decoding (module docstring of `scripts/step_overhead.py`). Per item: plain decoding's median step and "
             "what each arm's median step adds; per task and over all items: the median of that over plain's step.\n",
             "| task | item | prompt tokens | plain (ms) | " + " | ".join(f"+ {n} (ms)" for n in ARMS[1:]) + " |",
             "|---|---|---|---|" + "---|" * (len(ARMS) - 1)]
    for row in payload["rows"]:
        lines.append(f"| {row['task']} | {row['item']} | {row['prompt_tokens']} | {row['plain_ms']:.2f} | "
                     + " | ".join(f"{row['extra_ms'][n]:+.3f}" for n in ARMS[1:]) + " |")
    lines += ["", "| task (all: every item) | " + " | ".join(ARMS[1:]) + " |", "|---|" + "---|" * (len(ARMS) - 1)]
    for task, by_arm in payload["summary"].items():
        lines.append(f"| {task} | " + " | ".join(f"{v:+.1%}" for v in by_arm.values()) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
