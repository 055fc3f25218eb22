"""This machine's step costs for a target and a drafter (`StepCost`), measured once and cached.

`measure_step_cost` times the steps of a real greedy decode, the target and the drafter running exactly as
`KIND:auto` runs them (`decoding.step.DecodeStages.step`, its draft, verify, commit and argmax, with the caches
as decoding leaves them), from a prompt of random tokens at a short and at a long context. The steps follow
a fixed cycle of what each drafts and verifies, read from no timing:

    plain, plain, drafted 0, drafted 1, drafted K, drafted 0 of 1
                    (plain: the drafter does not run; drafted n: it proposes K and n of them are verified;
                     drafted 0 of 1: it proposes 1 and none is verified)

and each drafted step is divided by the second plain step of its cycle (adjacent in time, so a load that
comes and goes weighs on both alike; the first plain step, after a drafted one, is not used). The medians
over the cycles give, at each context S, in 1-token decodes at S:

    draft(K, S)              = drafted 0 / plain - 1    (the propose, and what it costs the verify after it:
                                                         the drafter's weights pushed the target's out of the caches)
    draft(1, S)              = drafted 0 of 1 / plain - 1
    first + n per_token(S)   = (drafted n - drafted 0) / plain,   n = 1 and K

and StepCost's lines are fitted through the two positions and the two contexts (S: the mean keys of each
context's timed steps):

    verify(n, S) / decode(S) - 1 = first_token + n * (per_token + per_token_key * S)
    draft(m, S) = draft + draft_per_position * m + draft_per_key * S

So a step is charged all that a step of `KIND:auto` pays (the verify's argmax and commit, the Python around
them, the caches as a propose leaves them), where forwards timed alone on a scratch pool would miss them.

The costs depend on the CPU, the thread count, the target and its dtype, and the drafter, so
`cached_step_cost` keys its file by all of them and by `METHOD` (`cache_root()/step_costs/`); a second run on
the same machine reads them back instead of timing again, which also keeps that run's draft lengths, and so
its sampled outputs, the same as the first's.

Legend: K drafted tokens, S context keys.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hspec.cache.paged_pool import pages_for
from hspec.decoding.step import DecodeStages
from hspec.drafters.base import DraftBatch, Drafter, Proposal
from hspec.drafters.step_cost import StepCost
from hspec.drafters.wrapping import WrappingDrafter
from hspec.machine import cpu_flags, cpu_model
from hspec.models.llama import TargetModel
from hspec.sampling import SamplingBatch, SamplingParams, greedy_tokens

METHOD = "decode steps: plain, plain, drafted 0, 1, K, 0 of 1"  # in the cache key: costs measured otherwise are retaken
CONTEXTS = (128, 1024)  # the prompt lengths of the short and the long decode the lines are fitted through
REPEATS = 24  # timed cycles per context; the median over them is kept
WARM_UP = 3  # untimed cycles before them


class FixedLengths(WrappingDrafter):
    """`model` made to draft `positions` and verify `length` of them this step (None: it does not run, the step
    is a plain decode); the caller sets both before each step (`positions` None: K). Exactly `length`, whatever
    the model would verify (a lookup without a match proposes padding): what the tokens are does not change what
    verifying them costs."""

    def __init__(self, model: Drafter) -> None:
        super().__init__(model)
        self.kind = model.kind
        self.length: int | None = None
        self.positions: int | None = None

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        B = len(batch.seq_ids)
        device = batch.anchor_tokens.device
        tokens = torch.zeros((B, K), dtype=torch.long, device=device)  # (B, K)
        if self.length is None:
            return Proposal(tokens, None, torch.zeros(B, dtype=torch.long, device=device))
        positions = K if self.positions is None else self.positions
        proposal = self.model.propose(batch, positions)
        tokens[:, :positions] = proposal.draft_tokens
        probs = proposal.draft_probs  # (B, positions, V) or None
        if probs is not None and positions < K:
            probs = torch.cat([probs, probs.new_zeros((B, K - positions, probs.shape[-1]))], dim=1)
        return Proposal(tokens, probs, torch.full((B,), self.length, dtype=torch.long, device=device))


def _cycle_ratios(target: TargetModel, drafter: Drafter, K: int, context: int, repeats: int,
                  generator: torch.Generator) -> tuple[dict[tuple[int, int], list[float]], float]:
    """Decode greedily from `context` random tokens through `WARM_UP` + `repeats` cycles (module docstring), or
    as many as the target's positions hold; returns, per (positions drafted, drafts verified) in {(K, 0), (K, 1),
    (K, K), (1, 0)}, each timed cycle's seconds(that step) / seconds(its plain step), and the mean keys of the
    timed steps."""
    drafted = [(K, 0), (K, 1), (K, K), (1, 0)] if K > 1 else [(1, 0), (1, 1)]
    lengths: tuple[tuple[int, int] | None, ...] = (None, None, *drafted)
    cycle_growth = len(lengths) * (K + 1)  # the most positions a cycle adds (every draft accepted)
    positions = min(context + (WARM_UP + repeats) * cycle_growth, target.config.max_position_embeddings)
    device = target.embed_tokens.weight.device
    fixed = FixedLengths(drafter)
    stages = DecodeStages(target, fixed, K, eos_token_ids=())
    page = 16
    pool = target.new_pool(pages_for(positions + K + 1, page), page, drafter.num_drafter_layers)
    prompt = torch.randint(0, target.config.vocab_size, (context,), generator=generator).tolist()
    sampling = SamplingBatch.from_params([SamplingParams()], device)
    generators = [torch.Generator(device=device).manual_seed(0)]
    ratios: dict[tuple[int, int], list[float]] = {step: [] for step in drafted}
    keys = []
    try:
        history = prompt + [int(greedy_tokens(stages.prefill(pool, 0, prompt))[0])]
        for cycle in range(WARM_UP + repeats):
            if pool.length(0) + cycle_growth > positions:
                break
            seconds: list[float] = []
            for step in lengths:
                fixed.positions, fixed.length = (None, None) if step is None else step
                keys.append(pool.length(0))
                start = time.perf_counter()
                result = stages.step(pool, [0], [history], sampling, generators)
                seconds.append(time.perf_counter() - start)
                history.extend(result.new_tokens[0])
            if cycle >= WARM_UP:
                for step, spent in zip(drafted, seconds[2:]):
                    ratios[step].append(spent / seconds[1])
    finally:
        stages.release(pool, 0)
    if not ratios[drafted[0]]:
        raise ValueError(f"a prompt of {context} tokens leaves the target's {target.config.max_position_embeddings}"
                         f" positions no room for {WARM_UP} + 1 cycles of {cycle_growth}; give shorter contexts")
    return ratios, statistics.mean(keys[WARM_UP * len(lengths):])


@torch.inference_mode()
def measure_step_cost(target: TargetModel, drafter: Drafter, K: int, contexts: Sequence[int] = CONTEXTS,
                      repeats: int = REPEATS, seed: int = 0) -> StepCost:
    """Time decode steps on this machine and fit StepCost (module docstring). A target of fewer positions than
    the long context and its cycles need (a test's tiny one) is timed from shorter prompts: the long one at half
    its positions, the short one at a quarter of that."""
    short, long = contexts
    if long > target.config.max_position_embeddings // 2:
        long = target.config.max_position_embeddings // 2
        short = min(short, long // 4)
    if not 0 < short < long:
        raise ValueError(f"contexts must be two lengths 0 < short < long, got {tuple(contexts)}")
    if K < 1:
        raise ValueError(f"K must be >= 1 to time a verify of drafted tokens, got {K}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1 timed cycle, got {repeats}")
    generator = torch.Generator().manual_seed(seed)
    fits = []  # per context: (mean keys, draft of K positions, per position, first_token, per_token)
    for context in (short, long):
        ratios, keys = _cycle_ratios(target, drafter, K, context, repeats, generator)
        zero = ratios[(K, 0)]
        draft = max(statistics.median(zero) - 1.0, 0.0)
        one = statistics.median([r1 - r0 for r0, r1 in zip(zero, ratios[(K, 1)])])
        if K > 1:
            block = statistics.median([rK - r0 for r0, rK in zip(zero, ratios[(K, K)])])
            per_token = max((block - one) / (K - 1), 0.0)
            per_position = max((draft - max(statistics.median(ratios[(1, 0)]) - 1.0, 0.0)) / (K - 1), 0.0)
        else:
            per_token, per_position = max(one, 0.0), 0.0
        fits.append((keys, draft, min(per_position, draft / K), max(one - per_token, 0.0), per_token))
    (keys_s, draft_s, position_s, first_s, token_s), (keys_l, draft_l, position_l, first_l, token_l) = fits
    span = max(keys_l - keys_s, 1.0)
    per_token_key = max((token_l - token_s) / span, 0.0)
    draft_per_key = max((draft_l - draft_s) / span, 0.0)
    per_position = (position_s + position_l) / 2
    return StepCost(draft=max(draft_s - draft_per_key * keys_s - per_position * K, 0.0),
                    per_token=max(token_s - per_token_key * keys_s, 0.0), per_token_key=per_token_key,
                    first_token=(first_s + first_l) / 2, draft_per_key=draft_per_key, draft_per_position=per_position)


def kernels_digest() -> str:
    """A digest of hspec's native sources (the CPU kernels, the decoder stack, native drafters) and of the
    cost model's fields: costs timed with other kernels, or fitted to another line, are measured again."""
    digest = hashlib.sha256(json.dumps(sorted(StepCost.__dataclass_fields__)).encode())
    root = Path(__file__).resolve().parents[1]
    for source in sorted([*root.rglob("*.cpp"), *root.rglob("*.h")]):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def machine_key(*parts: object) -> str:
    """A short digest of this CPU, the thread count, Python and torch, hspec's kernels, and `parts` (what was
    measured)."""
    text = json.dumps([platform.machine(), platform.processor(), cpu_model(), sorted(cpu_flags()),
                       torch.get_num_threads(), torch.__version__, sys.version_info[:2], kernels_digest(),
                       *map(str, parts)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_step_cost(cache_dir: Path, key_parts: tuple[object, ...], measure: Callable[[], StepCost]) -> StepCost:
    """The StepCost cached under `cache_dir` for this machine and `key_parts`, else `measure()` once and
    cache it (written to a temporary file and renamed, so a reader never sees half a file)."""
    path = cache_dir / f"{machine_key(METHOD, *key_parts)}.json"
    if path.exists():
        try:
            return StepCost(**json.loads(path.read_text())["cost"])
        except (ValueError, KeyError, TypeError):
            print(f"step costs at {path} are unreadable; measuring again", file=sys.stderr)
    print(f"measuring this machine's step costs for {', '.join(map(str, key_parts))} (once; cached in {path})",
          file=sys.stderr)
    cost = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"what": [str(p) for p in key_parts], "cost": cost.to_dict()}, indent=1))
    os.replace(tmp, path)
    return cost
