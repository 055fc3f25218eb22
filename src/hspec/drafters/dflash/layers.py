"""The Qwen3-style drafter layer whose attention reads a context K/V next to the block's own.

Shared by the DFlash family and P-Eagle (paper B.2: every reproduced baseline uses Qwen3 attention
with the target's (Hq, Hkv, D)). Like `BlockAttention`, it never writes the pool itself: it returns
the K/V it computed, and the drafter decides what to store.

Legend: N rows, T query positions (K for a block), S context keys, H hidden, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from hspec.drafters.block_attention import KV, BlockAttention
from hspec.drafters.config import DrafterConfig
from hspec.models.layers import RMSNorm, SwiGLU

__all__ = ["KV", "DraftLayer"]


class DraftLayer(nn.Module):
    """Pre-norm residual attention -> SwiGLU MLP with the target's dims (a Qwen3 decoder layer)."""

    def __init__(self, config: DrafterConfig, causal: bool) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = BlockAttention(config, causal)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = SwiGLU(H, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: KV | None,
                context_mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        """x (N, T, H) -> (N, T, H) and the T positions' own (k, v) (see `BlockAttention.forward`)."""
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, context, context_mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv
