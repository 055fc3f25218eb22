"""Drawing a block's drafts slot by slot when slot k's logits depend on the draft before it.

DSpark's Markov head adds a term to precomputed logits (`NeuralDrafter.sample_block`). Other kinds
make the dependence deeper: DFly corrects the hidden state with the previous token's embedding
before the LM head, DeLS-Spec advances a GRU over the drafted tokens, DFlash-2's path selector
scores the candidates of slot k against the draft of slot k-1. They all draw through
`sample_slots`, which owns the parts that keep verification exact:

1. one draw of K uniforms per row from the row's own generator (a row's drafts do not depend on
   which other rows share the batch);
2. slot k's logits l_k come from `slot_logits(k, prev_k)`, prev_0 = x0 and prev_k = d_k, so the
   draft distribution of slot k is conditioned on exactly the drafts the target will verify;
3. the target's sampling transform is applied to l_k (greedy rows take the argmax); the returned
   q_k is the distribution d_k was drawn from, which is what `verify` needs (decoding/verify.py).

Legend: B batch, K block, Vp pruned (draft) vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from hspec.drafters.base import DraftBatch
from hspec.drafters.common import CONTEXT_MULTIPLE, BlockContext, build_block
from hspec.sampling import SamplingBatch, draw_uniforms, sample_with_uniform

if TYPE_CHECKING:
    from hspec.drafters.common import NeuralDrafter


def inference_context(drafter: NeuralDrafter, batch: DraftBatch, K: int) -> BlockContext:
    """The block context of a proposal, read from the pool as `NeuralDrafter.propose` reads it.

    Checks K against the trained draft length (`max_draft_len`); the block [x0, MASK x (K-1)] sits at p..p+K-1.
    """
    if not 1 <= K <= drafter.config.max_draft_len:
        raise ValueError(f"K must be in 1..{drafter.config.max_draft_len} (the trained draft length), got {K}")
    lengths = batch.pool.lengths(batch.seq_ids)
    p = torch.tensor(lengths, dtype=torch.long, device=batch.anchor_tokens.device)  # (B,)
    block_tokens, positions = build_block(batch.anchor_tokens, p, K, drafter.config.mask_token_id)
    context_kv, context_mask = drafter.context_kv_from_pool(batch.pool, batch.seq_ids, lengths, CONTEXT_MULTIPLE)
    return BlockContext(block_tokens, positions, drafter.last_hidden_of(batch.seq_ids), context_kv, context_mask)


def sample_slots(slot_logits: Callable[[int, torch.Tensor], torch.Tensor], K: int, anchor_tokens: torch.Tensor,
                 to_target_ids: Callable[[torch.Tensor], torch.Tensor], sampling: SamplingBatch,
                 generators: Sequence[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw d_1..d_K, where slot k's logits are `slot_logits(k, prev)` with prev (B,) target ids.

    slot_logits returns (B, Vp) logits over the draft vocabulary (-inf where a slot cannot draft);
    to_target_ids maps draft-vocabulary indices to target ids. Returns the drafts as draft-vocabulary
    indices (B, K), their distributions (B, K, Vp) fp32, and the confidence (B, K): the largest
    probability of softmax(l_k) (`Proposal.confidence`: a function of the drafts before d_k, never of d_k).
    """
    all_greedy = sampling.all_greedy
    uniforms = None if all_greedy else draw_uniforms(generators, K, anchor_tokens.device)  # (B, K)
    prev = anchor_tokens  # (B,) target ids
    tokens, probs, confidence = [], [], []
    for k in range(K):
        l_k = slot_logits(k, prev).float()  # (B, Vp)
        if uniforms is None:
            d_k = l_k.argmax(-1)  # (B,)
            p_k = torch.zeros_like(l_k).scatter_(-1, d_k[:, None], 1.0)
        else:
            p_k = sampling.probs(l_k[:, None])[:, 0]  # (B, Vp)
            d_k = sample_with_uniform(p_k, uniforms[:, k])
        tokens.append(d_k)
        probs.append(p_k)
        confidence.append(torch.softmax(l_k, -1).amax(-1))
        prev = to_target_ids(d_k)
    return torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(confidence, 1)
