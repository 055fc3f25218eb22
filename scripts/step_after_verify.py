"""What a plain decode step costs right after a verify, by its distance from it: the surcharge `:auto`'s cost
model does not see (results/adaptive_length/README.md, "Step costs timed inside decoding").

One process, one thread count, the w4a8 target, Spec-Bench QA prompts. Each prompt is decoded by the decoding
stages (`DecodeStages.step`, as `hspec generate` runs them) in a repeating pattern of steps, each a plain step or
a verify of n `ngram` drafts (forced to n whatever the lookup found): all plain, "7 P P P" and "1 P P P". Each
pattern runs once as drafted (accepted drafts move the context on) and once with drafts no target accepts (every
pattern's context then grows alike). The patterns of a prompt run one after another, a fresh pool each; a step's
time is the median over the pattern's repeats after the first 8 steps, and each column is that median over the
prompts, in units of a step of the all-plain pattern.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/step_after_verify.py [--items 6] [--steps 48]
        [--out results/adaptive_length/step_after_verify]
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
from hspec.decoding.step_cost import FixedLengths  # noqa: E402
from hspec.drafters.base import DraftBatch, Proposal  # noqa: E402
from hspec.models.loading import load_target  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402
from hspec.runtime import build_drafter  # noqa: E402
from hspec.sampling import SamplingBatch, SamplingParams, greedy_tokens  # noqa: E402

K = 7
PATTERNS = {"P P P P": (None,) * 4, "7 P P P": (7, None, None, None), "1 P P P": (1, None, None, None)}
SKIPPED = 8  # steps of each pattern not timed (the pool's first pages, the first calls)


class NeverAccepted(FixedLengths):
    """`FixedLengths` whose drafts are one token id the target does not output here, so none is accepted."""

    def __init__(self, model, token: int) -> None:
        super().__init__(model)
        self.token = token

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        proposal = super().propose(batch, K)
        return Proposal(torch.full_like(proposal.draft_tokens, self.token), None, proposal.num_drafts)


def pattern_times(target, fixed: FixedLengths, prompt: list[int], pattern: tuple[int | None, ...], steps: int
                  ) -> list[float]:
    """Median seconds of each position of `pattern`, decoding `steps` steps from `prompt`."""
    stages = DecodeStages(target.model, fixed, K, eos_token_ids=())
    sampling = SamplingBatch.from_params([SamplingParams()])
    generators = [torch.Generator().manual_seed(0)]
    pool = target.model.new_pool(pages_for(len(prompt) + steps * (K + 1) + K + 1, 16), 16, 0)
    per_position: list[list[float]] = [[] for _ in pattern]
    try:
        history = list(prompt) + [int(greedy_tokens(stages.prefill(pool, 0, prompt))[0])]
        for i in range(steps):
            fixed.length = pattern[i % len(pattern)]
            start = time.perf_counter()
            result = stages.step(pool, [0], [history], sampling, generators)
            spent = time.perf_counter() - start
            history.extend(result.new_tokens[0])
            if i >= SKIPPED:
                per_position[i % len(pattern)].append(spent)
    finally:
        stages.release(pool, 0)
    return [statistics.median(times) for times in per_position]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=6, help="Spec-Bench QA prompts")
    parser.add_argument("--steps", type=int, default=48, help="decode steps per pattern and prompt")
    parser.add_argument("--out", type=Path, default=Path("results/adaptive_length/step_after_verify"))
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    target = load_target(None, dtype="w4a8")
    lookup = build_drafter("ngram", target)
    drafters = {"as drafted": FixedLengths(lookup),
                "never accepted": NeverAccepted(lookup, target.config.vocab_size - 1)}
    times = {(how, name): [] for how in drafters for name in PATTERNS}  # per prompt: per position
    with torch.inference_mode():
        for item in load_task("qa", args.items).items:
            prompt = target.tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}])
            for how, fixed in drafters.items():
                for name, pattern in PATTERNS.items():
                    times[how, name].append(pattern_times(target, fixed, prompt, pattern, args.steps))
    rows = []
    for how in drafters:
        unit = statistics.median(t for per_prompt in times[how, "P P P P"] for t in per_prompt)
        for name in PATTERNS:
            columns = list(zip(*times[how, name]))  # per position: its median over the prompts
            rows.append({"drafts": how, "pattern": name, "plain_step_ms": 1e3 * unit,
                         "by_position": [statistics.median(c) / unit for c in columns]})
    threads = torch.get_num_threads()
    settings = {"dtype": "w4a8", "K": K, "items": args.items, "steps": args.steps, "threads": threads,
                "load_average": _load_average()}
    command = f"python scripts/step_after_verify.py --items {args.items} --steps {args.steps}"
    payload = {"provenance": provenance(command, settings), "results": rows}
    json_path, md_path = write_results(args.out, f"step_after_verify_t{threads}", payload, markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


def markdown(payload: dict) -> str:
    lines = ["# A plain step's cost by its distance from a verify\n", provenance_markdown(payload["provenance"]),
             "\nEach pattern's steps in units of a step of the all-plain pattern (medians over the prompts; module "
             "docstring of `scripts/step_after_verify.py`). `7`: a verify of 7 drafts, `1`: of one, `P`: a plain "
             "step.\n", "| drafts | pattern | step 1 | step 2 | step 3 | step 4 | plain step (ms) |",
             "|---|---|---|---|---|---|---|"]
    for row in payload["results"]:
        lines.append(f"| {row['drafts']} | {row['pattern']} | "
                     + " | ".join(f"{v:.3f}" for v in row["by_position"]) + f" | {row['plain_step_ms']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
