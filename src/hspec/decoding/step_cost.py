"""This machine's step costs for a target and a drafter (`StepCost`), measured once and cached.

`measure_step_cost` times, on a scratch pool of random keys and values (no prefill needed: a forward's
cost does not depend on what the keys hold), the target's (K+1)-token verify against its 1-token decode at a
short and a long context, its 2-token verify (one drafted token) at the short one, and the drafter's propose
of K tokens followed by a decode against two decodes at both contexts, each the median of ratios of pairs
timed back to back (so a load that comes and goes weighs on both sides of a ratio), and fits StepCost's lines:

    verify(n, S) / decode(S) - 1 = first_token + n * (per_token + per_token_key * S)
        (n = K at two contexts: per_token_key; n = 1 and K at the short one: first_token and per_token)
    (propose(K) + decode after it - decode)(S) / decode(S) = draft + draft_per_key * S
        (the decode after a propose is dearer: the drafter's weights pushed the target's out of the caches)

The costs depend on the CPU, the thread count, the target and its dtype, and the drafter, so
`cached_step_cost` keys its file by all of them (`cache_root()/step_costs/`); a second run on the same
machine reads them back instead of timing again, which also keeps that run's draft lengths, and so its
sampled outputs, the same as the first's.

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
from collections.abc import Callable
from pathlib import Path

import torch

from hspec.cache.paged_pool import pages_for
from hspec.drafters.base import DraftBatch, Drafter
from hspec.drafters.step_cost import StepCost
from hspec.machine import cpu_flags, cpu_model
from hspec.models.llama import TargetModel
from hspec.sampling import SamplingBatch, SamplingParams

CONTEXTS = (128, 1024)  # the short and the long context the line is fitted through
REPEATS = 15  # paired timings per ratio; the median ratio is kept
WARM_UP = 3  # untimed runs before them


def _paired_ratios(run: Callable[[], object], reference: Callable[[], object], repeats: int) -> list[float]:
    """`repeats` ratios seconds(run) / seconds(reference), each of a pair timed back to back (the order
    alternating), so that another process's load, which comes and goes, weighs on both sides of a ratio alike."""
    for _ in range(WARM_UP):  # allocations, first-call dispatch, oneDNN's first products of a shape
        run()
        reference()
    ratios = []
    for i in range(repeats):
        times = {}
        for name, fn in ((("run", run), ("reference", reference)) if i % 2 == 0 else
                         (("reference", reference), ("run", run))):
            start = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - start
        ratios.append(times["run"] / times["reference"])
    return ratios


@torch.inference_mode()
def measure_step_cost(target: TargetModel, drafter: Drafter, K: int, contexts: tuple[int, int] = CONTEXTS,
                      repeats: int = REPEATS, seed: int = 0) -> StepCost:
    """Time decode, verify and propose on this machine and fit StepCost (module docstring)."""
    short, long = contexts
    if not 0 < short < long:
        raise ValueError(f"contexts must be two lengths 0 < short < long, got {contexts}")
    if K < 1:
        raise ValueError(f"K must be >= 1 to time a verify of drafted tokens, got {K}")
    c = target.config
    device = target.embed_tokens.weight.device
    g = torch.Generator().manual_seed(seed)
    page = 16
    pool = target.new_pool(pages_for(long + K + 1, page), page, drafter.num_drafter_layers)
    pool.add_sequence(0)
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    layers = drafter.target_layers
    decode_ids = torch.randint(0, c.vocab_size, (1, 1), generator=g).to(device)  # (1, 1)
    verify_ids = torch.randint(0, c.vocab_size, (1, K + 1), generator=g).to(device)  # (1, K+1)

    def forward(ids: torch.Tensor, length: int) -> Callable[[], object]:
        def run() -> object:
            out = target(ids, pool, [0], layers)
            pool.truncate(0, length)
            return out
        return run

    def verify_ratio(ids: torch.Tensor, length: int) -> float:  # median verify(ids) / decode at `length` keys
        pool.extend([0], length - pool.length(0))
        return statistics.median(_paired_ratios(forward(ids, length), forward(decode_ids, length), repeats))

    one = verify_ratio(verify_ids[:, :2], short) if K > 1 else None
    ratio_short, ratio_long = verify_ratio(verify_ids, short), verify_ratio(verify_ids, long)
    per_token_key = max((ratio_long - ratio_short) / (K * (long - short)), 0.0)
    # per drafted token at the short context: the step from 1 to K drafts; the first one's surcharge on top
    at_short = (ratio_short - 1.0) / K if one is None else max((ratio_short - one) / (K - 1), 0.0)
    first_token = 0.0 if one is None else max(one - 1.0 - at_short, 0.0)
    per_token_short = max(at_short - per_token_key * short, 0.0)

    def draft_ratio(length: int) -> float:
        """What a propose(K) at `length` keys adds to a step, in 1-token decodes at that context: the median
        of (propose + the decode after it) / (decode + decode), times 2, less 1; so the draft includes what it
        costs the decode after it (the drafter's weights push the target's out of the caches)."""
        pool.extend([0], length - pool.length(0))
        hidden = None
        if layers:
            hidden = torch.randn(1, length, len(layers), c.hidden_size, generator=g)  # (1, S, n_sel, H)
            hidden = hidden.to(target.embed_tokens.weight.dtype)
        drafter.commit(pool, [0], hidden, torch.tensor([length], device=device))
        history = torch.randint(0, c.vocab_size, (length + 1,), generator=g).tolist()
        batch = DraftBatch([0], torch.tensor([history[-1]], device=device), [history], pool,
                           SamplingBatch.from_params([SamplingParams()], device), [torch.Generator().manual_seed(seed)])
        decode = forward(decode_ids, length)

        def drafted_step() -> None:
            drafter.propose(batch, K)
            decode()

        def plain_steps() -> None:
            decode()
            decode()

        try:
            return 2.0 * statistics.median(_paired_ratios(drafted_step, plain_steps, repeats)) - 1.0
        finally:
            drafter.release(0)

    pool.truncate(0, short)
    draft_short = draft_ratio(short)
    draft_long = draft_ratio(long)
    draft_per_key = max((draft_long - draft_short) / (long - short), 0.0)
    return StepCost(draft=max(draft_short - draft_per_key * short, 0.0), per_token=per_token_short,
                    per_token_key=per_token_key, first_token=first_token, draft_per_key=draft_per_key)


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
    path = cache_dir / f"{machine_key(*key_parts)}.json"
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
