"""The speculative generate loop for B >= 1 sequences with ragged acceptance (DESIGN.md §3).

Named stages of one step, for all active sequences at once:
1. draft:   the drafter fills [x0, MASK x (K-1)] and proposes d_1..d_K with their distributions;
2. verify:  the target runs [x0, d_1..d_K] in one forward; `verify` picks the accepted prefix and
            the recovered/bonus token;
3. commit:  the KV pool keeps x0 and the accepted drafts and rolls back the rest; the drafter gets
            the hidden states of the committed positions;
4. emit:    accepted drafts + the new token join the output; EOS, the token limit or a stop
            string may end a sequence anywhere inside the block.

Plain decoding is the same loop with the `none` drafter (K = 0): every step verifies [x0] alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hspec.cache.paged_pool import PagedKVPool
from hspec.decoding.sampling import SamplingBatch, SamplingParams, draw_uniforms, sample_with_uniform
from hspec.decoding.verify import verify
from hspec.drafters.base import DraftBatch, Drafter
from hspec.metrics import AcceptanceStats, acceptance_stats, merge_stats
from hspec.models.llama import TargetModel


@dataclass
class SequenceOutput:
    """One sequence's result. `num_accepted` has one entry per speculative step (0..K)."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "length" or "stop"
    num_accepted: list[int] = field(default_factory=list)


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
        return merge_stats([acceptance_stats(s.num_accepted, self.K) for s in self.sequences])

    def metrics(self) -> dict[str, Any]:
        """Per-run metrics: MAL tau, per-position conditional acceptance, ITL, tokens/s, step times.

        ITL is decode time over the tokens decoding produced per sequence (the first token comes
        from the prefill); tokens/s counts every new token of the batch over prefill + decode.
        """
        stats = self.acceptance()
        decode_tokens = self.num_new_tokens - len(self.sequences)
        steps = len(self.verify_s)
        return {
            "K": self.K,
            "num_tokens": self.num_new_tokens,
            "num_steps": steps,
            "mean_accepted_length": stats.mean_accepted_length if stats else 1.0,
            "acceptance_by_position": list(stats.to_dict()["acceptance_by_position"]) if stats else [],
            "itl_ms": 1000 * self.decode_s * len(self.sequences) / max(decode_tokens, 1),
            "tokens_per_s": self.num_new_tokens / max(self.prefill_s + self.decode_s, 1e-9),
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "draft_ms_per_step": 1000 * sum(self.draft_s) / max(steps, 1),
            "verify_ms_per_step": 1000 * sum(self.verify_s) / max(steps, 1),
        }


class SpeculativeDecoder:
    """Couples a target, a drafter and a KV pool; `generate` is lossless for every drafter."""

    def __init__(self, target: TargetModel, drafter: Drafter, K: int, eos_token_ids: Sequence[int],
                 decode_text: Callable[[list[int]], str] | None = None) -> None:
        if drafter.drafts and K < 1:
            raise ValueError(f"K (tokens drafted per step) must be >= 1, got {K}")
        drafter.check_target(target.config)
        self.target = target
        self.drafter = drafter
        self.K = K if drafter.drafts else 0
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode_text = decode_text

    def new_pool(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int = 16
                 ) -> PagedKVPool:
        """A pool just big enough for these prompts, their outputs and one block of drafts each."""
        per_seq = [-(-(len(p) + max_new_tokens + self.K + 1) // block_size) for p in prompts]
        return self.target.new_pool(sum(per_seq), block_size, self.drafter.num_pool_layers)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams],
                 max_new_tokens: int, stop: Sequence[str] = (), seeds: Sequence[int] | None = None,
                 pool: PagedKVPool | None = None) -> GenerationOutput:
        """Generate for each prompt; row i uses `seeds[i]` (default i) for its random draws."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        self._check_request(prompts, params, max_new_tokens, stop)
        device = self.target.embed_tokens.weight.device
        seeds = list(range(len(prompts))) if seeds is None else list(seeds)
        generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        pool = pool or self.new_pool(prompts, max_new_tokens)
        seq_ids = [self._fresh_id(pool) + i for i in range(len(prompts))]
        outputs = [SequenceOutput(list(p)) for p in prompts]
        histories = [list(p) for p in prompts]
        sampling_all = SamplingBatch.from_params(params, device)

        start = time.perf_counter()
        anchors = [self._prefill(pool, seq_ids[i], prompts[i], sampling_all.select([i]), generators[i])
                   for i in range(len(prompts))]
        for i, token in enumerate(anchors):
            histories[i].append(token)
            self._emit(outputs[i], [token], max_new_tokens, stop)
        prefill_s = time.perf_counter() - start

        draft_s: list[float] = []
        verify_s: list[float] = []
        active = [i for i in range(len(prompts)) if outputs[i].finish_reason is None]
        while active:
            ids = [seq_ids[i] for i in active]
            batch_sampling = sampling_all.select(active)
            t0 = time.perf_counter()
            proposal = self.drafter.propose(DraftBatch(
                ids, torch.tensor([histories[i][-1] for i in active], device=device),
                [histories[i] for i in active], pool, batch_sampling, [generators[i] for i in active],
            ), self.K)
            t1 = time.perf_counter()
            accepted, new_tokens = self._verify_and_commit(pool, ids, active, histories, proposal,
                                                           batch_sampling, generators)
            t2 = time.perf_counter()
            draft_s.append(t1 - t0)
            verify_s.append(t2 - t1)
            for row, i in enumerate(active):
                if self.K:
                    outputs[i].num_accepted.append(accepted[row])
                histories[i].extend(new_tokens[row])
                self._emit(outputs[i], new_tokens[row], max_new_tokens, stop)
            active = [i for i in active if outputs[i].finish_reason is None]
        decode_s = time.perf_counter() - start - prefill_s
        for s in seq_ids:
            pool.free(s)
            self.drafter.release(s)
        return GenerationOutput(outputs, self.K, prefill_s, decode_s, draft_s, verify_s)

    # ---- stages -------------------------------------------------------------------------------

    def _prefill(self, pool: PagedKVPool, seq_id: int, prompt: Sequence[int], sampling: SamplingBatch,
                 generator: torch.Generator) -> int:
        """Run the prompt into the pool and draw the first new token (the first anchor x0)."""
        pool.add_sequence(seq_id)
        device = self.target.embed_tokens.weight.device
        ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
        out = self.target(ids, pool, [seq_id], self.drafter.hidden_layers, last_logits_only=True)
        self.drafter.commit(pool, [seq_id], out.hidden, torch.tensor([len(prompt)], device=device))
        probs = sampling.probs(out.logits)[:, -1]  # (1, V)
        token = sample_with_uniform(probs, draw_uniforms([generator], 1, device)[:, 0])
        return int(token[0])

    def _verify_and_commit(self, pool: PagedKVPool, ids: list[int], active: list[int],
                           histories: list[list[int]], proposal, sampling: SamplingBatch,
                           generators: list[torch.Generator]) -> tuple[list[int], list[list[int]]]:
        """Stages 2 and 3; returns accepted counts and the tokens each row emits."""
        device = proposal.draft_tokens.device
        anchors = torch.tensor([[histories[i][-1]] for i in active], dtype=torch.long, device=device)
        block = torch.cat([anchors, proposal.draft_tokens], dim=1)  # (B, K+1)
        out = self.target(block, pool, ids, self.drafter.hidden_layers)
        target_probs = sampling.probs(out.logits)  # (B, K+1, V)
        uniforms = draw_uniforms([generators[i] for i in active], self.K + 1, device)  # (B, K+1)
        result = verify(target_probs, proposal.draft_probs, proposal.draft_tokens,
                        uniforms[:, : self.K], uniforms[:, self.K])
        accepted = result.num_accepted.tolist()  # the step's one host sync
        next_tokens = result.next_tokens.tolist()
        drafts = proposal.draft_tokens.tolist()
        for row, seq_id in enumerate(ids):
            # Keep x0 and the accepted drafts; the new token is the next anchor, not yet cached.
            pool.truncate(seq_id, pool.length(seq_id) - self.K + accepted[row])
        self.drafter.commit(pool, ids, out.hidden, result.num_accepted + 1)
        return accepted, [drafts[row][: accepted[row]] + [next_tokens[row]] for row in range(len(ids))]

    def _emit(self, output: SequenceOutput, tokens: list[int], max_new_tokens: int, stop: Sequence[str]
              ) -> None:
        """Append a block of tokens, ending the sequence at EOS, the limit or a stop string."""
        before = len(output.token_ids)
        for token in tokens:
            output.token_ids.append(token)
            if token in self.eos_token_ids:
                output.finish_reason = "eos"
                break
            if len(output.token_ids) >= max_new_tokens:
                output.finish_reason = "length"
                break
        if stop and self.decode_text is not None:
            cut = _stop_prefix_length(output.token_ids, before, stop, self.decode_text)
            if cut is not None:
                del output.token_ids[cut:]
                output.finish_reason = "stop"

    def _check_request(self, prompts: Sequence[Sequence[int]], params: list[SamplingParams],
                       max_new_tokens: int, stop: Sequence[str]) -> None:
        if not prompts:
            raise ValueError("no prompts given")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling settings for {len(prompts)} prompts")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop and self.decode_text is None:
            raise ValueError("stop strings need a decode_text function")
        context = self.target.config.max_position_embeddings
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            needed = len(prompt) + max_new_tokens + self.K + 1
            if needed > context:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} and K={self.K} "
                    f"it needs {needed} positions, more than the target's context of {context}"
                )
            bad = [t for t in prompt if not 0 <= t < self.target.config.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, "
                                 f"{self.target.config.vocab_size}): {bad[:5]}")

    @staticmethod
    def _fresh_id(pool: PagedKVPool) -> int:
        existing = pool.sequence_ids()
        return max(existing) + 1 if existing else 0


def _stop_prefix_length(token_ids: list[int], checked: int, stop: Sequence[str],
                        decode_text: Callable[[list[int]], str]) -> int | None:
    """Smallest n > checked such that decode(token_ids[:n]) contains a stop string, or None.

    The first `checked` tokens were already searched, so a new match must end after them. Searching
    token by token makes the cut independent of how many tokens a step emitted, so plain and
    speculative decoding stop at the same token.
    """
    if not any(s in decode_text(token_ids) for s in stop):
        return None
    for n in range(checked + 1, len(token_ids) + 1):
        if any(s in decode_text(token_ids[:n]) for s in stop):
            return n
    return None
