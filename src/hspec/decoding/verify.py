"""Speculative verification: which drafted tokens the target accepts, and the token that follows.

Leviathan et al. (2023), Algorithm 1: draft token d_k, drawn from the draft distribution q_k, is
accepted with probability min(1, p_k(d_k) / q_k(d_k)), where p_k is the target's distribution at
that position. At the first rejection the next token is drawn from the residual
norm(max(0, p_k - q_k)); if all K drafts pass, a bonus token is drawn from p_{K+1}. Then, per
position, P(token = x) = q(x) min(1, p(x)/q(x)) + (1 - beta) residual(x) = p(x) with
beta = sum_x min(p(x), q(x)): the output has exactly the target's distribution.

Greedy decoding is the special case where p and q are one-hot (see `sampling.py`): the acceptance
probability is 1 when d_k is the target's argmax and 0 otherwise, and the residual is the argmax.

Legend: B batch, K drafted tokens, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hspec.sampling import sample_with_uniform


@dataclass(frozen=True)
class VerifyResult:
    """num_accepted: (B,) drafts accepted per row, 0..K (at most the row's num_drafts).
    next_tokens: (B,) the recovered token (after a rejection) or the bonus token (all accepted).
    """

    num_accepted: torch.Tensor
    next_tokens: torch.Tensor


def greedy_verdict(best: list[list[int]], drafts: list[list[int]], limits: list[int]) -> tuple[list[int], list[int]]:
    """`verify` for greedy rows, from the target's argmax at each of a row's L+1 positions (`best`, B lists of
    L+1), its L drafts (`drafts`) and how many of them it verifies (`limits`, each <= L): each row's accepted
    drafts and its next token.

    With one-hot p and q (greedy), `verify` accepts d_k exactly when it is the target's argmax, and the
    recovered or bonus token is the argmax after the accepted prefix; this computes that directly, skipping
    the (B, L+1, V) one-hots, gathers and residuals (docs/fast-path.md). It runs on the host: a decode step
    reads its tokens there anyway, and a loop over B rows costs less than the torch operators on (B, L)
    tensors that the same verdict takes on the device.
    """
    num_accepted, next_tokens = [], []
    for row, limit in enumerate(limits):
        n = 0
        while n < limit and drafts[row][n] == best[row][n]:
            n += 1
        num_accepted.append(n)
        next_tokens.append(best[row][n])
    return num_accepted, next_tokens


def acceptance_prob(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p / q) elementwise; where q is 0 the token is never drafted, and we return 1."""
    return torch.where(q > 0, torch.clamp(p / q.clamp_min(torch.finfo(q.dtype).tiny), max=1.0),
                       torch.ones_like(p))


def residual_dist(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim. If p == q the residual is never used; return p then."""
    residual = torch.clamp(p - q, min=0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def verify(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
           uniform_accept: torch.Tensor, uniform_sample: torch.Tensor,
           num_drafts: torch.Tensor | None = None) -> VerifyResult:
    """Verify a batch of K-token drafts in one go (no host synchronisation).

    A row with num_drafts n < K is verified as if it had drafted d_1..d_n only: drafts after n are
    never accepted, and when all n pass the bonus token comes from p_{n+1}, exactly as for a block of
    n drafts (the padding drafts after n are ignored, whatever they are).

    target_probs: (B, K+1, V) target distributions at the K draft positions and the one after.
    draft_probs: (B, K, V) draft distributions the drafts were drawn from.
    draft_tokens: (B, K) long.
    uniform_accept: (B, K) in [0, 1), one per acceptance test.
    uniform_sample: (B,) in [0, 1), for the recovered or bonus token.
    num_drafts: (B,) long in 0..K, drafts to verify per row (0: the target's own token only); None verifies all K.
    """
    b, k1, v = target_probs.shape
    k = k1 - 1
    if draft_tokens.shape != (b, k) or draft_probs.shape != (b, k, v):
        raise ValueError(
            f"shapes disagree: target_probs {tuple(target_probs.shape)}, draft_probs "
            f"{tuple(draft_probs.shape)}, draft_tokens {tuple(draft_tokens.shape)}"
        )
    index = draft_tokens[..., None]
    p_draft = target_probs[:, :k].gather(-1, index).squeeze(-1)  # (B, K)
    q_draft = draft_probs.gather(-1, index).squeeze(-1)  # (B, K)
    # u < p/q, written without a division; q > 0 for any token actually drawn from q.
    accepted = uniform_accept * q_draft < p_draft  # (B, K)
    limit = torch.full((b,), k, dtype=torch.long, device=target_probs.device) if num_drafts is None else num_drafts
    accepted &= torch.arange(k, device=target_probs.device) < limit[:, None]
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # (B,) length of the accepted prefix
    rows = torch.arange(b, device=target_probs.device)
    p_next = target_probs[rows, num_accepted]  # (B, V)
    # The draft distribution after the last verified draft is zero, so the bonus token comes from p itself.
    q_next = draft_probs[rows, num_accepted.clamp(max=max(k - 1, 0))] if k else torch.zeros_like(p_next)
    q_next = torch.where((num_accepted < limit)[:, None], q_next, torch.zeros_like(q_next))
    next_tokens = sample_with_uniform(residual_dist(p_next, q_next), uniform_sample)
    return VerifyResult(num_accepted, next_tokens)
