"""The README's main job: each drafter against plain decoding on a few prompts, on one target.

Every method first decodes a few tokens untimed (allocations, first-call dispatch), then the runs are
interleaved per prompt, the order rotating from prompt to prompt, so machine noise and cache warmth hit
every method alike. Greedy outputs must match plain decoding token for token; a mismatch is an error.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters import PLAIN
from hspec.drafters.cost_aware import CostAwareDrafter
from hspec.metrics import merge_stats
from hspec.models.loading import Target, load_target
from hspec.runtime import build_drafter
from hspec.sampling import SamplingParams

WARM_UP_TOKENS = 8  # untimed tokens each method decodes before the timed runs


def run_demo(target_name: str, drafter_kinds: Sequence[str], K: int, max_new_tokens: int,
             prompts: Sequence[str], dtype: str = "auto") -> int:
    started = time.perf_counter()
    return demo_on(load_target(target_name, dtype=dtype), drafter_kinds, K, max_new_tokens, prompts, started)


def demo_on(target: Target, drafter_kinds: Sequence[str], K: int, max_new_tokens: int, prompts: Sequence[str],
            started: float) -> int:
    """`run_demo` on a loaded target; `started`: the perf_counter the run's total time counts from."""
    kinds = [PLAIN, *[k for k in drafter_kinds if k != PLAIN]]
    decoders = {kind: SpeculativeDecoder(target.model, build_drafter(kind, target, K=K),
                                         K, target.tokenizer.eos_token_ids) for kind in kinds}
    greedy = SamplingParams()
    decode_s = dict.fromkeys(kinds, 0.0)
    tokens = dict.fromkeys(kinds, 0)
    stats: dict[str, list] = {kind: [] for kind in kinds}
    steps = dict.fromkeys(kinds, 0)  # decoding steps, and those that drafted (the rest: :auto's plain steps)
    drafted_steps = dict.fromkeys(kinds, 0)
    print(f"target {target.name} | dtype {target.model.dtype_name} | K={K} | greedy | "
          f"max_new_tokens={max_new_tokens} | {torch.get_num_threads()} threads\n")
    warm_up = target.tokenizer.encode_prompt(prompts[0])
    for dec in decoders.values():
        dec.generate([warm_up], greedy, WARM_UP_TOKENS)
    for i, prompt in enumerate(prompts):
        ids = target.tokenizer.encode_prompt(prompt)
        order = kinds[i % len(kinds):] + kinds[:i % len(kinds)]  # rotate who runs first
        outputs = {kind: decoders[kind].generate([ids], greedy, max_new_tokens) for kind in order}
        reference = outputs[PLAIN].sequences[0].token_ids
        print(f"--- prompt {i + 1}: {prompt}\n{target.tokenizer.decode(reference).strip()}\n")
        for kind, out in outputs.items():
            if out.sequences[0].token_ids != reference:
                raise RuntimeError(f"drafter {kind} changed the greedy output on prompt {i + 1}: lossless bug")
            decode_s[kind] += out.decode_s
            tokens[kind] += out.num_new_tokens - 1
            if out.acceptance() is not None:
                stats[kind].append(out.acceptance())
            steps[kind] += len(out.sequences[0].num_drafted)
            drafted_steps[kind] += sum(n > 0 for n in out.sequences[0].num_drafted)
    width = max(12, *(len(kind) + 1 for kind in kinds))
    print(f"{'method':<{width}} {'MAL':>6} {'drafted':>8} {'tok/s':>8} {'speedup':>8}   (decode phase, all prompts; "
          f"MAL over the steps that drafted)")
    for kind in kinds:
        mal = merge_stats(stats[kind]).mean_accepted_length if stats[kind] else 1.0
        mal_text = "-" if math.isnan(mal) else f"{mal:.2f}"  # nan: no step drafted
        drafted = f"{drafted_steps[kind] / steps[kind]:.0%}" if steps[kind] else "-"
        rate = tokens[kind] / decode_s[kind]
        speedup = decode_s[PLAIN] / decode_s[kind]
        print(f"{kind:<{width}} {mal_text:>6} {drafted:>8} {rate:>8.1f} {speedup:>7.2f}x")
    costs = {kind: dec.drafter.cost for kind, dec in decoders.items() if isinstance(dec.drafter, CostAwareDrafter)}
    if costs:
        each = [f"{kind} a draft of {K} {cost.draft + K * cost.draft_per_position:.2f} (of 1 "
                f"{cost.draft + cost.draft_per_position:.2f}), each verified token {cost.per_token:.2f}"
                for kind, cost in costs.items()]
        print("\nthis machine's step costs, in 1-token decodes (what `:auto` drafts by): " + "; ".join(each))
        looking = [kind for kind, dec in decoders.items() if kind in costs and dec.drafter.outlook is not None]
        if looking:
            print("whether a row drafts, and how many positions where each costs, judged before drafting by the "
                  "drafter's outlook "
                  f"(docs/guide/generate.md#the-draft-length-that-pays-auto): {', '.join(looking)}")
    print(f"\nall outputs identical to plain greedy decoding ({time.perf_counter() - started:.0f} s in all)")
    return 0
