"""The stages of one speculative decoding step, shared by the generate loop and the serving engine.

`DecodeStages` couples a target, a drafter and K, and exposes each stage of docs/design.md#the-decoding-step on its own,
so a caller chooses which sequences take part in each step:

- `prefill`:  run a sequence's context into the pool (its first turn, or a recompute after
              preemption) and give the drafter the hidden states of every position; `prefill_copy`
              gives another sequence of the same tokens a copy of it without running the target again;
- `first_token`: draw the first anchor x0 from the prefill's last logits;
- `step`:     for a batch of running sequences, 1. draft, 2. verify, 3. commit/rollback, with ragged
              acceptance per row (`step_tree` when the drafter drafts token trees, `proposes_tree`);
- `step_plain`: a plain decoding step for a batch that skips speculation (the serving engine's
              `speculate_max_batch`); the drafter's state still follows the sequence;
- `emit`:     4. append a row's new tokens, ending it at EOS, the token limit or a stop string.

Every random draw comes from the row's own `torch.Generator` and a step always draws the same number
of uniforms per row (1 for the first token, K+1 per step; a tree step: node budget + 1), so a row's
output does not depend on the other rows of its batch, nor on whether it was preempted and recomputed
in between.

Legend: B batch, K drafted tokens, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hspec.cache.paged_pool import PagedKVPool
from hspec.decoding.tree_step import tree_step
from hspec.decoding.verify import greedy_verdict, verify
from hspec.drafters.base import DraftBatch, Drafter
from hspec.models.llama import TargetModel
from hspec.sampling import SamplingBatch, draw_uniforms, greedy_tokens, sample_with_uniform


@dataclass
class SequenceOutput:
    """One sequence's result. `num_accepted` and `num_drafted` have one entry per speculative step:
    drafts accepted (0..num_drafted) and drafts verified (0..K; K unless the drafter stopped early, 0 for a
    plain decode step the cost-aware length chose)."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "length" or "stop"
    num_accepted: list[int] = field(default_factory=list)
    num_drafted: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Prefilled:
    """What a prefill gave one sequence, kept so that a sequence of the same tokens can take a copy of it
    (`DecodeStages.prefill_copy`) instead of running the target again."""

    seq_id: int
    logits: torch.Tensor  # (1, V) the last position's
    hidden: torch.Tensor | None  # (1, T, n_sel, H) the hidden states the drafter committed; None without layers


@dataclass(frozen=True)
class StepResult:
    """What one batched draft -> verify -> commit step produced, one entry per row."""

    num_accepted: list[int]  # drafts accepted per row, 0..num_drafted
    num_drafted: list[int]  # drafts verified per row, 0..K (K for drafters that never stop early)
    new_tokens: list[list[int]]  # accepted drafts + the recovered/bonus token, per row
    draft_s: float  # seconds in the drafter (whole batch)
    verify_s: float  # seconds in the target forward + verification + commit (whole batch)


class DecodeStages:
    """The stages of the decoding loop for one target, drafter and K (K = 0 for plain decoding)."""

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

    @property
    def device(self) -> torch.device:
        return self.target.embed_tokens.weight.device

    @property
    def growth(self) -> int:
        """Positions one step writes per row before its rollback: the verify block [x0, d_1..d_K] (K + 1),
        [x0 ; the tree's nodes] (node budget + 1) for a drafter that proposes trees, 1 for plain decoding."""
        return self.drafter.draft_positions(self.K) + 1 if self.K else 1

    def positions_needed(self, prompt_length: int, max_new_tokens: int) -> int:
        """Most positions a request ever holds in the pool: prompt, outputs and one step's block (or tree)."""
        return prompt_length + max_new_tokens + self.growth

    # ---- stages -------------------------------------------------------------------------------

    def prefill(self, pool: PagedKVPool, seq_id: int, tokens: Sequence[int],
                prompt_length: int | None = None) -> torch.Tensor:
        """Add `seq_id` to the pool holding `tokens` and commit them to the drafter.

        Used for a prompt (then the caller draws x0 with `first_token`) and for a recompute after
        preemption, where `tokens` is the history without its last token, which is already x0.
        Returns the last position's logits, (1, V).

        `prompt_length` (default: all of `tokens`): how many leading tokens are the prompt. They run as
        a prompt's prefill (`TargetModel.prefill`) and the rest as decoding did, so a
        recompute writes the K/V bits the sequence had before it was preempted.
        """
        return self.prefill_and_keep(pool, seq_id, tokens, prompt_length).logits

    def prefill_and_keep(self, pool: PagedKVPool, seq_id: int, tokens: Sequence[int],
                         prompt_length: int | None = None) -> Prefilled:
        """`prefill`, returning what `prefill_copy` needs to repeat it for another sequence."""
        n = len(tokens) if prompt_length is None else prompt_length
        if not 0 < n <= len(tokens):
            raise ValueError(f"prompt_length must be in 1..{len(tokens)} (the tokens to prefill), got {n}")
        pool.add_sequence(seq_id)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # (1, T)
        layers = self.drafter.target_layers
        out = self.target.prefill(ids[:, :n], pool, [seq_id], layers, last_logits_only=True)
        hidden = out.hidden  # (1, n, n_sel, H) or None
        if n < len(tokens):
            out = self.target(ids[:, n:], pool, [seq_id], layers, last_logits_only=True)
            hidden = None if hidden is None else torch.cat([hidden, out.hidden], dim=1)  # (1, T, n_sel, H)
        self.drafter.commit(pool, [seq_id], hidden, torch.tensor([len(tokens)], device=self.device))
        return Prefilled(seq_id, out.logits[:, -1], hidden)

    def prefill_copy(self, pool: PagedKVPool, seq_id: int, source: Prefilled) -> torch.Tensor:
        """`prefill` of `seq_id` with the tokens `source` was prefilled with, without running the target: the
        pool copies its K/V and the drafter commits the same hidden states, so the sequence holds the bits its
        own prefill would give it (a prefill's bits depend on its tokens alone). `source`'s sequence must not
        have moved on since. Returns the last position's logits, (1, V)."""
        pool.copy_sequence(source.seq_id, seq_id)
        self.drafter.commit(pool, [seq_id], source.hidden, torch.tensor([pool.length(seq_id)], device=self.device))
        return source.logits

    def first_token(self, logits: torch.Tensor, sampling: SamplingBatch, generator: torch.Generator) -> int:
        """Draw x0 from the prefill's last logits (1, V) with one uniform of the row's generator."""
        probs = sampling.probs(logits[:, None])[:, -1]  # (1, V)
        return int(sample_with_uniform(probs, draw_uniforms([generator], 1, self.device)[:, 0])[0])

    def step(self, pool: PagedKVPool, seq_ids: Sequence[int], histories: Sequence[Sequence[int]],
             sampling: SamplingBatch, generators: Sequence[torch.Generator]) -> StepResult:
        """Stages 1-3 for a batch of running sequences; `histories[b]` ends with row b's anchor x0.

        The pool must be able to grow every row by `draft_positions(K)` + 1 positions (K+1 for a chain;
        the caller's scheduler checks `pool.can_hold`); after the step each row keeps x0 and its
        accepted drafts.
        """
        if self.drafter.proposes_tree:
            return self.step_tree(pool, seq_ids, histories, sampling, generators)
        t0 = time.perf_counter()
        anchors = torch.tensor([h[-1] for h in histories], dtype=torch.long, device=self.device)  # (B,)
        # 1. draft: d_1..d_K and the distributions they were drawn from; each row may ask to verify
        #    only its first n drafts (0: a plain decode), so the block shrinks to the longest row's L <= K.
        proposal = self.drafter.propose(
            DraftBatch(list(seq_ids), anchors, histories, pool, sampling, list(generators)), self.K)
        num_drafts = proposal.num_drafts
        drafted = [self.K] * len(seq_ids) if num_drafts is None else num_drafts.tolist()
        if num_drafts is not None and not all(0 <= n <= self.K for n in drafted):
            raise ValueError(f"drafter {self.drafter.kind!r} asked to verify {drafted} drafts per row; "
                             f"each must be in 0..K = 0..{self.K}")
        L = max(drafted, default=self.K)  # 0: every row decodes plainly this step
        drafts_t = proposal.draft_tokens[:, :L]  # (B, L)
        t1 = time.perf_counter()
        # 2. verify: the target scores [x0, d_1..d_L] at positions p..p+L in one forward.
        block = torch.cat([anchors[:, None], drafts_t], dim=1) if L else anchors[:, None]  # (B, L+1)
        out = self.target(block, pool, seq_ids, self.drafter.target_layers)
        drafts = drafts_t.tolist()
        if sampling.all_greedy:  # the same verdict as `verify` on one-hot distributions, read on the host
            limits = [min(n, drafts_t.shape[1]) for n in drafted]
            accepted, next_tokens = greedy_verdict(greedy_tokens(out.logits).tolist(), drafts, limits)
        else:
            uniforms = draw_uniforms(generators, self.K + 1, self.device)  # (B, K+1): the same draws whatever L is
            target_probs = sampling.probs(out.logits)  # (B, L+1, V)
            draft_probs = proposal.probs(target_probs.shape[-1])[:, :L]  # (B, L, V)
            result = verify(target_probs, draft_probs, drafts_t, uniforms[:, :L], uniforms[:, self.K], num_drafts)
            accepted = result.num_accepted.tolist()  # the step's one host sync
            next_tokens = result.next_tokens.tolist()
        # 3. commit: keep x0 and the accepted drafts; the new token is the next anchor, not yet cached.
        for row, seq_id in enumerate(seq_ids):
            pool.truncate(seq_id, pool.length(seq_id) - L + accepted[row])
        committed = torch.tensor(accepted, dtype=torch.long, device=self.device) + 1  # (B,)
        self.drafter.commit(pool, seq_ids, out.hidden, committed)
        new_tokens = [drafts[row][: accepted[row]] + [next_tokens[row]] for row in range(len(seq_ids))]
        return StepResult(accepted, drafted, new_tokens, t1 - t0, time.perf_counter() - t1)

    def step_plain(self, pool: PagedKVPool, seq_ids: Sequence[int], histories: Sequence[Sequence[int]],
                   sampling: SamplingBatch, generators: Sequence[torch.Generator]) -> StepResult:
        """One plain decoding step for a batch that skips speculation: no draft, the target scores the
        anchor x0 alone (a (B, 1) forward) and each row draws its next token from those logits.

        The drafter still commits x0's hidden states, exactly as after a step that accepted no draft,
        so the next speculative step drafts from the right state. Each row draws one uniform (greedy
        rows take the argmax), and num_accepted / num_drafted are 0 for every row.
        """
        t0 = time.perf_counter()
        anchors = torch.tensor([h[-1] for h in histories], dtype=torch.long, device=self.device)  # (B,)
        out = self.target(anchors[:, None], pool, seq_ids, self.drafter.target_layers)  # logits (B, 1, V)
        uniforms = draw_uniforms(generators, 1, self.device)[:, 0]  # (B,)
        if sampling.all_greedy:
            next_tokens = greedy_tokens(out.logits[:, -1])  # (B,)
        else:
            next_tokens = sample_with_uniform(sampling.probs(out.logits)[:, -1], uniforms)  # (B,)
        committed = torch.ones(len(seq_ids), dtype=torch.long, device=self.device)  # (B,): x0 only
        self.drafter.commit(pool, seq_ids, out.hidden, committed)
        zeros = [0] * len(seq_ids)
        return StepResult(zeros, zeros, [[token] for token in next_tokens.tolist()], 0.0, time.perf_counter() - t0)

    def step_tree(self, pool: PagedKVPool, seq_ids: Sequence[int], histories: Sequence[Sequence[int]],
                  sampling: SamplingBatch, generators: Sequence[torch.Generator]) -> StepResult:
        """`step` for a drafter that proposes trees: 1. draft a tree of depth <= K per row, 2. verify it
        in one target forward with the tree's ancestor mask, 3. keep the accepted path (tree_step.py).

        num_drafted is each row's tree depth (the longest path verified), so acceptance by position
        stays conditional on the depths a step could reach. Each row draws draft_positions(K) + 1
        uniforms per step whatever its tree's size.
        """
        t0 = time.perf_counter()
        anchors = torch.tensor([h[-1] for h in histories], dtype=torch.long, device=self.device)  # (B,)
        draft = self.drafter.propose_tree(
            DraftBatch(list(seq_ids), anchors, histories, pool, sampling, list(generators)), self.K)
        drafted = draft.depths().tolist()
        if not all(0 <= d <= self.K for d in drafted):
            raise ValueError(f"drafter {self.drafter.kind!r} drafted trees of depth {drafted}; each must be in "
                             f"0..K = 0..{self.K} (0: the row drafted nothing)")
        t1 = time.perf_counter()
        result = tree_step(self.target, pool, seq_ids, anchors, draft, sampling, generators,
                           self.drafter.target_layers, self.drafter.draft_positions(self.K) + 1)
        self.drafter.commit(pool, seq_ids, result.hidden, result.num_committed)
        accepted = result.verified.num_accepted.tolist()
        return StepResult(accepted, drafted, result.new_tokens, t1 - t0, time.perf_counter() - t1)

    def emit(self, output: SequenceOutput, tokens: Sequence[int], max_new_tokens: int,
             stop: Sequence[str] = ()) -> list[int]:
        """4. Append a block of tokens, ending the sequence at EOS, the limit or a stop string.

        Returns the tokens that joined the output (a prefix of `tokens`, possibly empty only if
        `tokens` is). Earlier outputs are never cut: a stop string must end inside the new tokens.
        """
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
            cut = stop_prefix_length(output.token_ids, before, stop, self.decode_text)
            if cut is not None:
                del output.token_ids[cut:]
                output.finish_reason = "stop"
        return output.token_ids[before:]

    def release(self, pool: PagedKVPool, seq_id: int) -> None:
        """Free a sequence's KV blocks and the drafter's state for it."""
        if pool.has_sequence(seq_id):
            pool.free(seq_id)
        self.drafter.release(seq_id)

    # ---- validation ---------------------------------------------------------------------------

    def check_request(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[str] = (),
                      name: str = "prompt") -> None:
        """Raise ValueError, naming the bad value, if this request cannot run on the target."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop and self.decode_text is None:
            raise ValueError("stop strings need a decode_text function")
        if len(prompt) == 0:
            raise ValueError(f"{name} is empty")
        context = self.target.config.max_position_embeddings
        needed = self.positions_needed(len(prompt), max_new_tokens)
        if needed > context:
            raise ValueError(
                f"{name} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} and K={self.K} "
                f"it needs {needed} positions, more than the target's context of {context}"
            )
        vocab = self.target.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")


STOP_CONTEXT_TOKENS = 8  # tokens decoded before a stop string's own: a token's text may depend on the one before


def stop_window(stop: Sequence[str]) -> int:
    """How many trailing tokens are decoded to look for `stop`: a stop string of L characters spans at
    most 4L tokens (every token adds at least one byte, a character has at most 4), plus
    STOP_CONTEXT_TOKENS before it (a SentencePiece word's leading space shows only after a token)."""
    return 4 * max(len(s) for s in stop) + STOP_CONTEXT_TOKENS


def stop_prefix_length(token_ids: list[int], checked: int, stop: Sequence[str],
                       decode_text: Callable[[list[int]], str]) -> int | None:
    """Smallest n > checked such that the text of the last `stop_window(stop)` tokens of token_ids[:n]
    contains a stop string, or None.

    The first `checked` tokens were already searched, so a new match must end after them. The window
    ends at n and depends on nothing else, so the cut is independent of how many tokens a step emitted
    (plain and speculative decoding stop at the same token), and a step decodes O(window + new tokens)
    tokens however long the output grew.
    """
    window = stop_window(stop)
    # 1. One decode covering every window that ends in the new tokens: no stop string there, no match.
    if not any(s in decode_text(token_ids[max(0, checked + 1 - window):]) for s in stop):
        return None
    # 2. The first n whose own window holds one.
    for n in range(checked + 1, len(token_ids) + 1):
        if any(s in decode_text(token_ids[max(0, n - window):n]) for s in stop):
            return n
    return None
