"""Sampling transforms (temperature, top-k, top-p) as pure functions over logits.

The same transform is applied to the target's and the drafter's logits (docs/design.md#verification), so
speculative sampling reproduces the distribution a user asked for. Temperature 0 means greedy: the
"distribution" is one-hot on the argmax, which makes greedy verification the special case of
stochastic verification whose acceptance probabilities are exactly 0 or 1.

Legend: B batch, T positions, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from hspec.models.native import kernels_loaded


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples."""

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 divides the logits
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose mass reaches top_p; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters of a batch, as tensors.

    temperature: (B,) float, 0 for greedy rows. top_p: (B,) float. top_k: (B,) long, 0 = off.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> SamplingBatch:
        return cls(
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
        )

    def select(self, rows: torch.Tensor | Sequence[int]) -> SamplingBatch:
        """The parameters of a subset of rows."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.temperature.device)
        return SamplingBatch(self.temperature[index], self.top_p[index], self.top_k[index])

    @cached_property
    def all_greedy(self) -> bool:
        """Every row decodes greedily (temperature 0). Read by the step and the drafter alike, so kept: its three
        tensor operators cost ~60 us right after a verify."""
        return bool((self.temperature == 0).all())

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, T, V) logits -> (B, T, V) fp32 probabilities under each row's transform."""
        return probs_from_logits(logits, self.temperature, self.top_p, self.top_k)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits -> (...) the greedy token: the argmax of the fp32 copy, the first index of the largest
    value (a NaN the largest). Every greedy path (the one-hots below, `decoding.verify.greedy_verdict`, a plain
    decode's step) takes it from here, so they break ties alike. Where hspec's CPU kernels are loaded, bf16 and
    fp32 CPU logits take `hspec::greedy_tokens`, the same index without the copy (torch's argmax took ~130 us
    a 49,152-value row on one core, docs/fast-path.md)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32) and kernels_loaded():
        return torch.ops.hspec.greedy_tokens(logits.detach())
    return logits.float().argmax(-1)


def probs_from_logits(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                      top_k: torch.Tensor) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p, per row; greedy rows become one-hot argmax.

    logits (B, T, V); temperature, top_p (B,) float; top_k (B,) long. Returns (B, T, V) fp32.
    """
    logits = logits.float()
    greedy = temperature == 0  # (B,)
    if bool(greedy.all()):  # fast path: no softmax needed
        return torch.zeros_like(logits).scatter_(-1, greedy_tokens(logits)[..., None], 1.0)
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / safe_t[:, None, None]
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1).any())
    if need_k or need_p:
        scaled = _truncate(scaled, top_p, top_k, need_p)
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, greedy_tokens(logits)[..., None], 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


def _truncate(scaled: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, need_p: bool) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf. scaled (B, T, V).

    Rows are truncated in groups of equal settings (the same k, top-p on or off), each group exactly
    as it would be alone: how many candidates are sorted, and so how ties among them fall, never
    depends on the other rows of the batch, and neither does a sampled row's distribution.
    """
    vocab = scaled.shape[-1]
    k_eff = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))  # (B,)
    uses_p = top_p < 1 if need_p else torch.zeros_like(top_p, dtype=torch.bool)  # (B,)
    out = scaled.clone()
    for k, p_on in sorted(set(zip(k_eff.tolist(), uses_p.tolist()))):
        if k == vocab and not p_on:
            continue  # nothing to cut
        rows = ((k_eff == k) & (uses_p == p_on)).nonzero()[:, 0]  # (B_g,)
        out[rows] = _truncate_rows(scaled[rows], top_p[rows], k, p_on)
    return out


def _truncate_rows(scaled: torch.Tensor, top_p: torch.Tensor, k: int, use_p: bool) -> torch.Tensor:
    """`_truncate` for rows that share k and whether top-p applies. scaled (B, T, V), top_p (B,)."""
    # Only the k best candidates can survive, so sort just those (cheap when top-k is set).
    values, indices = torch.topk(scaled, k, dim=-1)  # (B, T, k) descending
    if use_p:
        probs = torch.softmax(values, dim=-1)
        mass_before = probs.cumsum(-1) - probs  # mass of strictly better tokens
        values = values.masked_fill(mass_before >= top_p[:, None, None], float("-inf"))  # the best survives
    return torch.full_like(scaled, float("-inf")).scatter_(-1, indices, values)


def sample_with_uniform(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs (..., V) unnormalised non-negative, uniform (...) in [0, 1).

    Returns the token ids (...). Tokens with zero mass are never chosen. Taking the uniforms as input
    keeps this pure and lets each request bring its own generator.
    """
    cdf = probs.double().cumsum(-1)  # (..., V); fp64 so the tail mass of a large vocab stays exact
    target = uniform.double() * cdf[..., -1]
    index = torch.searchsorted(cdf, target[..., None], right=True).squeeze(-1)
    return index.clamp(max=probs.shape[-1] - 1)


def draw_uniforms(generators: Sequence[torch.Generator], count: int, device: torch.device | str = "cpu"
                  ) -> torch.Tensor:
    """(B, count) uniforms in [0, 1), row b from generators[b] (so results do not depend on batching)."""
    rows = [torch.rand(count, generator=g, device=g.device) for g in generators]
    return torch.stack(rows).to(device) if rows else torch.empty((0, count), device=device)
