"""The unified drafter loss (docs/design.md#training, paper App. B.3).

Per block position k = 1..K (slot k-1 predicts x_{p+k}):
    loss_k = 0.1 * CE(q_k, x_{p+k}) + 0.9 * TV(q_k, p_k),   TV = 1/2 * ||q_k - p_k||_1,
weighted by w_k = exp(-(k-1)/gamma), gamma = 4, and averaged with those weights. The draft
distribution q_k lives on the pruned vocabulary; the target's p_k on the full one. Mass of p_k outside
the pruned vocabulary is mass q_k can never cover, so it adds to TV in full; a ground-truth token
outside the pruned vocabulary has no CE term.

Legend: N blocks, K block positions, Vp pruned vocab, V full vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1  # weight of the cross-entropy to the ground-truth next token
    tv: float = 0.9  # weight of the total variation to the target's distribution
    gamma: float = 4.0  # position decay: w_k = exp(-(k-1)/gamma)

    def __post_init__(self) -> None:
        if self.ce < 0 or self.tv < 0 or self.ce + self.tv == 0:
            raise ValueError(f"loss weights must be >= 0 and not both 0, got ce={self.ce}, tv={self.tv}")
        if self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")


def position_weights(K: int, gamma: float = 4.0, device: torch.device | str = "cpu") -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..K, shape (K,)."""
    return torch.exp(-torch.arange(K, dtype=torch.float32, device=device) / gamma)


def total_variation(q_pruned: torch.Tensor, p_on_vocab: torch.Tensor) -> torch.Tensor:
    """1/2 ||q - p||_1 with q (..., Vp) and p's probabilities of the same Vp tokens (..., Vp); returns (...)."""
    outside = (1.0 - p_on_vocab.sum(-1)).clamp(min=0.0)  # p's mass q cannot place
    return 0.5 * ((q_pruned - p_on_vocab).abs().sum(-1) + outside)


@dataclass(frozen=True)
class LossParts:
    """loss: the weighted scalar to minimise; ce, tv: (K,) per-position means (for logging)."""

    loss: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor


def drafter_loss(logits: torch.Tensor, target_on_vocab: torch.Tensor, labels: torch.Tensor, vocab_ids: torch.Tensor,
                 valid: torch.Tensor | None = None, weights: LossWeights = LossWeights(), groups: int = 1) -> LossParts:
    """The weighted 0.1 CE + 0.9 TV loss over blocks.

    logits: (N, K, Vp) draft logits (after the Markov head). target_on_vocab: (N, K, Vp) the target's
    probabilities of the pruned vocabulary's tokens at the same positions (its full distribution
    restricted; the rest of its mass is 1 - their sum). labels: (N, K) ground-truth target token ids.
    vocab_ids: (Vp,) target ids of the pruned vocabulary. valid: (N, K) bool, False for positions past
    the sequence end. groups: G dividing N; the rows are G groups of N/G consecutive rows (a training
    step's sequences) and each position's means are taken within a group, the loss and the means then
    averaged over the groups, so every sequence weighs alike however many of its labels are valid (a group
    without any valid label adds 0).
    """
    n, K, vp = logits.shape
    if groups < 1 or n % groups:
        raise ValueError(f"groups must be >= 1 and divide the {n} rows, got {groups}")
    valid = torch.ones((n, K), dtype=torch.bool, device=logits.device) if valid is None else valid
    log_q = F.log_softmax(logits.float(), dim=-1)  # (N, K, Vp)
    tv = total_variation(log_q.exp(), target_on_vocab.float())  # (N, K)
    local = local_ids(labels, vocab_ids)  # (N, K); tokens outside the pruned vocabulary get no CE term
    has_ce = valid & (local >= 0)
    ce = -log_q.gather(-1, local.clamp(min=0)[..., None]).squeeze(-1)  # (N, K)
    w = position_weights(K, weights.gamma, logits.device)  # (K,)
    tv_sum = (tv * valid).view(groups, -1, K).sum(1)  # (G, K)
    ce_sum = (ce * has_ce).view(groups, -1, K).sum(1)  # (G, K)
    tv_mean = tv_sum / valid.view(groups, -1, K).sum(1).clamp(min=1)  # (G, K)
    ce_mean = ce_sum / has_ce.view(groups, -1, K).sum(1).clamp(min=1)  # (G, K)
    loss = (w * (weights.ce * ce_mean + weights.tv * tv_mean)).sum() / (w.sum() * groups)
    return LossParts(loss, ce_mean.detach().mean(0), tv_mean.detach().mean(0))


def local_ids(ids: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Target ids (...) -> their indices in the pruned vocabulary `vocab_ids` (Vp,), -1 for ids outside it.

    A binary search in the sorted vocabulary: no table sized by the largest id, so nothing here reads a
    tensor's value on the host (a compiled or captured step cannot)."""
    sorted_ids, order = vocab_ids.sort()  # (Vp,) each
    at = torch.searchsorted(sorted_ids, ids).clamp(max=vocab_ids.shape[0] - 1)  # (...)
    return torch.where(sorted_ids[at] == ids, order[at], -1)


def greedy_acceptance(logits: torch.Tensor, target_argmax: torch.Tensor, vocab_ids: torch.Tensor,
                      valid: torch.Tensor | None = None) -> torch.Tensor:
    """Validation: per block, how many leading slots a greedy verifier would accept, (N,).

    Slot k is accepted when the draft's argmax equals the target's argmax and all earlier slots were.
    With teacher-forced Markov inputs this is exact for greedy decoding as long as the earlier drafts
    were accepted, which is precisely the condition of the conditional acceptance at slot k.
    logits: (N, K, Vp) draft logits; target_argmax: (N, K) the target's greedy tokens; vocab_ids: (Vp,).
    """
    draft = vocab_ids[logits.argmax(-1)]  # (N, K) target ids
    match = draft == target_argmax  # (N, K)
    if valid is not None:
        match &= valid
    return match.long().cumprod(-1).sum(-1)
