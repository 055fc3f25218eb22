"""The speculative generate loop for B >= 1 sequences with ragged acceptance (docs/design.md#the-decoding-step).

Named stages of one step, for all active sequences at once (implemented in `step.DecodeStages`,
which the serving engine shares):
1. draft:   the drafter fills [x0, MASK x (K-1)] and proposes d_1..d_K with their distributions;
2. verify:  the target runs [x0, d_1..d_K] in one forward; `verify` picks the accepted prefix and
            the recovered/bonus token;
3. commit:  the KV pool keeps x0 and the accepted drafts and rolls back the rest; the drafter gets
            the hidden states of the committed positions;
4. emit:    accepted drafts + the new token join the output; EOS, the token limit or a stop
            string may end a sequence anywhere inside the block.

Plain decoding is the same loop with the `none` drafter (K = 0): every step verifies [x0] alone.
This loop runs a fixed batch to completion; `hspec.serving.engine` runs the same stages with
requests joining and leaving between steps. Rows with the same prompt (n samples of one prompt) run its
prefill once; the others take a copy of it (`DecodeStages.prefill_copy`), with the same bits.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hspec.cache.paged_pool import PagedKVPool, pages_for
from hspec.decoding.step import DecodeStages, Prefilled, SequenceOutput, stop_prefix_length
from hspec.drafters.base import Drafter
from hspec.metrics import AcceptanceStats, acceptance_stats, merge_stats
from hspec.models.llama import TargetModel
from hspec.sampling import SamplingBatch, SamplingParams

__all__ = ["GenerationOutput", "SequenceOutput", "SpeculativeDecoder", "stop_prefix_length"]


@dataclass
class GenerationOutput:
    """Results of one `generate` call, with its timings (seconds)."""

    sequences: list[SequenceOutput]
    K: int
    prefill_s: float
    decode_s: float
    draft_s: list[float]  # per step, whole batch
    verify_s: list[float]  # per step, whole batch (target forward + verification + commit)

    @property
    def num_new_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    def acceptance(self) -> AcceptanceStats | None:
        """Merged acceptance statistics (None for plain decoding, which drafts nothing)."""
        if self.K == 0:
            return None
        return merge_stats([acceptance_stats(s.num_accepted, self.K, s.num_drafted) for s in self.sequences])

    def metrics(self) -> dict[str, Any]:
        """Per-run metrics: MAL tau, per-position conditional acceptance, ITL, two tokens/s, step times.

        ITL is decode time over the tokens decoding produced per sequence (the first token comes
        from the prefill). Two rates, named apart because a long prompt's prefill can take most of a
        run: `decode_tokens_per_s`, the tokens decoding produced over the decode phase (what speedups
        compare), and `tokens_per_s_with_prefill`, every new token over prefill + decode.
        """
        stats = self.acceptance()
        summary = stats.to_dict() if stats else None  # JSON's None where NaN
        decode_tokens = self.num_new_tokens - len(self.sequences)
        steps = len(self.verify_s)
        row_steps = sum(len(s.num_drafted) for s in self.sequences)
        drafted = sum(n > 0 for s in self.sequences for n in s.num_drafted)
        return {
            "K": self.K,
            "num_tokens": self.num_new_tokens,
            "num_steps": steps,
            # over the steps that drafted; None where none did (a `:auto` run that kept to plain steps)
            "mean_accepted_length": summary["mean_accepted_length"] if summary else 1.0,
            "drafted_share": drafted / row_steps if row_steps else 0.0,  # of the rows' steps, those that drafted
            "acceptance_by_position": list(summary["acceptance_by_position"]) if summary else [],
            "itl_ms": 1000 * self.decode_s * len(self.sequences) / max(decode_tokens, 1),
            "decode_tokens_per_s": decode_tokens / max(self.decode_s, 1e-9),
            "tokens_per_s_with_prefill": self.num_new_tokens / max(self.prefill_s + self.decode_s, 1e-9),
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "draft_ms_per_step": 1000 * sum(self.draft_s) / max(steps, 1),
            "verify_ms_per_step": 1000 * sum(self.verify_s) / max(steps, 1),
        }


class SpeculativeDecoder:
    """Couples a target, a drafter and a KV pool; `generate` is lossless for every drafter."""

    def __init__(self, target: TargetModel, drafter: Drafter, K: int, eos_token_ids: Sequence[int],
                 decode_text: Callable[[list[int]], str] | None = None) -> None:
        self.stages = DecodeStages(target, drafter, K, eos_token_ids, decode_text)
        self.target = target
        self.drafter = drafter
        self.K = self.stages.K
        self.eos_token_ids = self.stages.eos_token_ids
        self.decode_text = decode_text

    def new_pool(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, page_size: int = 16
                 ) -> PagedKVPool:
        """A pool just big enough for these prompts, their outputs and one block of drafts each."""
        per_seq = [pages_for(self.stages.positions_needed(len(p), max_new_tokens), page_size) for p in prompts]
        return self.target.new_pool(sum(per_seq), page_size, self.drafter.num_drafter_layers)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams],
                 max_new_tokens: int, stop: Sequence[str] = (), seeds: Sequence[int] | None = None,
                 pool: PagedKVPool | None = None) -> GenerationOutput:
        """Generate for each prompt; row i uses `seeds[i]` (default i) for its random draws."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if not prompts:
            raise ValueError("no prompts given")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling settings for {len(prompts)} prompts")
        for i, prompt in enumerate(prompts):
            self.stages.check_request(prompt, max_new_tokens, stop, name=f"prompt {i}")
        stages = self.stages
        device = stages.device
        seeds = list(range(len(prompts))) if seeds is None else list(seeds)
        generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        pool = pool or self.new_pool(prompts, max_new_tokens)
        seq_ids = [self._fresh_id(pool) + i for i in range(len(prompts))]
        outputs = [SequenceOutput(list(p)) for p in prompts]
        histories = [list(p) for p in prompts]
        sampling_all = SamplingBatch.from_params(params, device)

        # Whatever happens (a full caller-supplied pool, an interrupt), the pool and drafter end as
        # they started: every sequence this call added is released.
        try:
            start = time.perf_counter()
            repeated = {prompt for prompt, count in Counter(map(tuple, prompts)).items() if count > 1}
            kept: dict[tuple[int, ...], Prefilled] = {}  # a repeated prompt's first prefill, which the others copy
            for i, prompt in enumerate(prompts):
                key = tuple(prompt)
                if key in kept:
                    logits = stages.prefill_copy(pool, seq_ids[i], kept[key])
                else:
                    done = stages.prefill_and_keep(pool, seq_ids[i], prompt)
                    logits = done.logits
                    if key in repeated:
                        kept[key] = done
                token = stages.first_token(logits, sampling_all.select([i]), generators[i])
                histories[i].append(token)
                stages.emit(outputs[i], [token], max_new_tokens, stop)
            prefill_s = time.perf_counter() - start

            draft_s: list[float] = []
            verify_s: list[float] = []
            active = [i for i in range(len(prompts)) if outputs[i].finish_reason is None]
            while active:
                result = stages.step(pool, [seq_ids[i] for i in active], [histories[i] for i in active],
                                     sampling_all.select(active), [generators[i] for i in active])
                draft_s.append(result.draft_s)
                verify_s.append(result.verify_s)
                for row, i in enumerate(active):
                    if self.K:
                        outputs[i].num_accepted.append(result.num_accepted[row])
                        outputs[i].num_drafted.append(result.num_drafted[row])
                    histories[i].extend(result.new_tokens[row])
                    stages.emit(outputs[i], result.new_tokens[row], max_new_tokens, stop)
                active = [i for i in active if outputs[i].finish_reason is None]
            decode_s = time.perf_counter() - start - prefill_s
        finally:
            for s in seq_ids:
                stages.release(pool, s)
        return GenerationOutput(outputs, self.K, prefill_s, decode_s, draft_s, verify_s)

    @staticmethod
    def _fresh_id(pool: PagedKVPool) -> int:
        existing = pool.sequence_ids()
        return max(existing) + 1 if existing else 0
