"""The DFlash-2 drafter: DFlash + two-tap dynamic depthwise convolutions + the path selector
(config.py has the equations).

Forward over a block [x0, MASK x (K-1)] at positions p..p+K-1:
1. context: as DFlash, c_t = RMSNorm(W_fc · concat(h_t)) projected per layer into the drafter-side
   KV cache in the pool (written by `commit`);
2. 5 layers; in each, for the attention and then the MLP sublayer f:
   z = RMSNorm(x); delta = W_delta z (per slot, 2 taps x G groups); x = x + conv_post(f(conv_pre(z))),
   both convolutions mixing slot i with slot i-1 of the block through base + delta;
3. the final norm gives h_t (N, K, H), the pruned LM head U_t (N, K, Vp), and the path selector's
   per-slot candidates (top-C of U_t) and query W h_t (N, K, r);
4. drafting walks the slots: S_t(prev, b) over the C candidates b, prev_0 = x0, prev_t = d_t; the
   draft is drawn from the sampling transform of S_t restricted to the candidates, which is the q_t
   verification reads (zero outside the candidates).

Legend: N rows, K block, H hidden, G = H / group channel groups, Vp pruned vocab, V vocab,
C candidates per slot, r selector rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hspec.drafters.base import DRAFTERS, DraftBatch, Proposal
from hspec.drafters.block_attention import KV, BlockAttention
from hspec.drafters.common import BlockContext
from hspec.drafters.dflash.model import DFlashDrafter
from hspec.drafters.dflash2.config import DFlash2Config
from hspec.drafters.sequential import inference_context, sample_slots
from hspec.models.layers import RMSNorm, SwiGLU


def two_tap_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """out[:, i, c] = (base[0, c] + delta[:, i, 0, c]) x[:, i, c] + (base[1, c] + delta[:, i, 1, c]) x[:, i-1, c].

    x (N, K, H); base (2, H); delta (N, K, 2, H) expanded to channels. x[:, -1] is zero: the taps do
    not cross the block boundary.
    """
    previous = F.pad(x, (0, 0, 1, 0))[:, :-1]  # (N, K, H): slot i holds x[:, i-1], slot 0 zeros
    weight = base + delta  # (N, K, 2, H)
    return weight[:, :, 0] * x + weight[:, :, 1] * previous


class DynamicConvPair(nn.Module):
    """The convolutions around one sublayer: one delta projection H -> 2G, a base for each side."""

    def __init__(self, hidden: int, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size
        self.delta_proj = nn.Linear(hidden, 2 * (hidden // group_size), bias=False)
        nn.init.zeros_(self.delta_proj.weight)  # with base = (1, 0) both convolutions start as the identity
        identity = torch.stack([torch.ones(hidden), torch.zeros(hidden)])  # (2, H)
        self.base_pre = nn.Parameter(identity.clone())
        self.base_post = nn.Parameter(identity.clone())

    def delta(self, z: torch.Tensor) -> torch.Tensor:
        """z (N, K, H) -> delta (N, K, 2, H): one value per tap and group, repeated over its channels."""
        n, k, _ = z.shape
        groups = self.delta_proj(z).view(n, k, 2, -1)  # (N, K, 2, G)
        return groups.repeat_interleave(self.group_size, dim=-1)  # (N, K, 2, H)


class DFlash2Layer(nn.Module):
    """A DFlash layer (pre-norm attention over [context ; block], then SwiGLU) with the convolutions."""

    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        H, eps, g = config.hidden_size, config.rms_norm_eps, config.conv_group_size
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = BlockAttention(config, causal=False)
        self.attn_conv = DynamicConvPair(H, g)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = SwiGLU(H, config.intermediate_size)
        self.mlp_conv = DynamicConvPair(H, g)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: KV | None,
                context_mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        """x (N, K, H) -> (N, K, H) and the block's own (k, v) (see `BlockAttention.forward`)."""
        z = self.input_layernorm(x)
        delta = self.attn_conv.delta(z)  # (N, K, 2, H), shared by the two convolutions
        attn, kv = self.self_attn(two_tap_conv(z, self.attn_conv.base_pre, delta), cos, sin, context, context_mask)
        x = x + two_tap_conv(attn, self.attn_conv.base_post, delta)
        z = self.post_attention_layernorm(x)
        delta = self.mlp_conv.delta(z)
        return x + two_tap_conv(self.mlp(two_tap_conv(z, self.mlp_conv.base_pre, delta)), self.mlp_conv.base_post,
                                delta), kv


class PathSelector(nn.Module):
    """S_t(a, b) = U_t(b) + <A[a] * (W h_t), B[b]> over the C candidates b of slot t.

    A and B are indexed by target ids (the previous token may be any token; the candidates are draft
    vocabulary tokens mapped back to target ids). B starts at zero, so an untrained selector walks
    the backbone's own top candidate.
    """

    def __init__(self, vocab_size: int, hidden: int, rank: int) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, rank, bias=False)  # W
        self.A = nn.Embedding(vocab_size, rank)
        self.B = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.A.weight, std=rank**-0.5)
        nn.init.zeros_(self.B.weight)

    def scores(self, query: torch.Tensor, prev_tokens: torch.Tensor, candidate_logits: torch.Tensor,
               candidate_tokens: torch.Tensor) -> torch.Tensor:
        """query (..., r) = W h_t; prev_tokens (...) target ids; candidate_logits U_t(b) (..., C);
        candidate_tokens (..., C) target ids -> S (..., C)."""
        mixed = self.A(prev_tokens) * query  # (..., r)
        return candidate_logits + (self.B(candidate_tokens) @ mixed[..., None]).squeeze(-1)  # (..., C)


@DRAFTERS.register("dflash2")
class DFlash2Drafter(DFlashDrafter):
    """DFlash-2: DFlash layers with dynamic two-tap convolutions, drafting through the path selector."""

    config_class = DFlash2Config
    config: DFlash2Config
    sequential_head = True  # the trainer calls `training_logits` (the selector needs the previous token)

    def build(self) -> None:
        c = self.config
        self.layers = nn.ModuleList(DFlash2Layer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.fc = nn.Linear(len(c.target_layers) * c.hidden_size, c.hidden_size, bias=False)  # W_fc
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.selector = PathSelector(c.vocab_size, c.hidden_size, c.selector_rank)

    # ---- forward -----------------------------------------------------------------------------------

    def block_logits(self, ctx: BlockContext) -> torch.Tensor:
        """U (N, K, Vp): the backbone's logits, from which each slot's candidates are taken."""
        return self.head(self.block_hidden(ctx))

    def candidates(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., Vp) -> the C best draft-vocabulary indices (..., C)."""
        return logits.topk(self.config.selector_candidates, dim=-1).indices

    def restricted(self, scores: torch.Tensor, candidates: torch.Tensor, vocab: int) -> torch.Tensor:
        """Scores (..., C) at candidates (..., C) -> logits (..., Vp), -inf outside the candidates."""
        full = scores.new_full((*scores.shape[:-1], vocab), float("-inf"))
        return full.scatter(-1, candidates, scores)

    def selector_scores(self, hidden: torch.Tensor, logits: torch.Tensor, prev_tokens: torch.Tensor,
                        candidates: torch.Tensor) -> torch.Tensor:
        """S (..., C): hidden (..., H), logits U (..., Vp), prev_tokens (...), candidates (..., C)."""
        query = self.selector.query(hidden)  # (..., r)
        return self.selector.scores(query, prev_tokens, logits.gather(-1, candidates),
                                    self.head.to_target_ids(candidates))

    def teacher_forced_logits(self, ctx: BlockContext, prev_tokens: torch.Tensor) -> torch.Tensor:
        """(N, K, Vp): S_t(prev_t, .) on slot t's candidates, -inf elsewhere; prev (N, K) teacher-forced."""
        hidden = self.block_hidden(ctx)  # (N, K, H)
        logits = self.head(hidden)  # (N, K, Vp)
        candidates = self.candidates(logits)  # (N, K, C)
        scores = self.selector_scores(hidden, logits, prev_tokens, candidates)
        return self.restricted(scores, candidates, logits.shape[-1])

    def training_logits(self, ctx: BlockContext, prev_tokens: torch.Tensor, labels: torch.Tensor,
                        valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The backbone's U (N, K, Vp) for the unified loss, and the selector's weighted C-way CE.

        labels (N, K) target ids; valid (N, K). A gold token outside slot t's candidates replaces
        the last candidate; a gold token outside the draft vocabulary has no term. U is detached in
        the selector's scores, so the selector's loss reaches the backbone only through its query W h_t,
        and not at all when `config.selector_trains_backbone` is False.
        """
        hidden = self.block_hidden(ctx)  # (N, K, H)
        logits = self.head(hidden)  # (N, K, Vp)
        vp = logits.shape[-1]
        to_local = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=logits.device)
        to_local[self.head.draft_vocab_ids] = torch.arange(vp, device=logits.device)
        gold = to_local[labels]  # (N, K) draft-vocabulary index, -1 outside it
        candidates = self.candidates(logits.detach())  # (N, K, C)
        present = (candidates == gold[..., None]).any(-1)  # (N, K)
        candidates[..., -1] = torch.where(present | (gold < 0), candidates[..., -1], gold)
        query_hidden = hidden if self.config.selector_trains_backbone else hidden.detach()
        scores = self.selector_scores(query_hidden, logits.detach(), prev_tokens, candidates)  # (N, K, C)
        target = (candidates == gold[..., None]).float().argmax(-1)  # (N, K) the gold token's slot
        ce = F.cross_entropy(scores.float().flatten(0, 1), target.flatten(), reduction="none").view_as(target)
        counted = valid & (gold >= 0)
        # The unified loss's position weights w_k = exp(-(k-1)/4) (training/losses.py, gamma = 4).
        w = torch.exp(-torch.arange(logits.shape[1], dtype=torch.float32, device=logits.device) / 4.0)  # (K,)
        per_slot = (ce * counted).sum(0) / counted.sum(0).clamp(min=1)  # (K,)
        loss = self.config.selector_loss_weight * (w * per_slot).sum() / w.sum()
        return logits, loss

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        """One backbone forward, then the selector's walk over the candidates (module docstring)."""
        hidden = self.block_hidden(inference_context(self, batch, K))  # (B, K, H)
        logits = self.head(hidden)  # (B, K, Vp)
        candidates = self.candidates(logits)  # (B, K, C)
        query = self.selector.query(hidden)  # (B, K, r)
        candidate_logits = logits.gather(-1, candidates)  # (B, K, C)
        candidate_tokens = self.head.to_target_ids(candidates)  # (B, K, C)
        vp = logits.shape[-1]

        def slot_logits(k: int, prev: torch.Tensor) -> torch.Tensor:
            scores = self.selector.scores(query[:, k], prev, candidate_logits[:, k], candidate_tokens[:, k])
            return self.restricted(scores, candidates[:, k], vp)  # (B, Vp)

        local, probs, confidence = sample_slots(slot_logits, K, batch.anchor_tokens, self.head.to_target_ids,
                                                batch.sampling, batch.generators)
        return Proposal(self.head.to_target_ids(local), self.head.to_full(probs), confidence=confidence)
