"""Qwen3-style drafter layers whose attention reads a context K/V next to the block's own.

Shared by the DFlash family and P-Eagle (paper B.2: every reproduced baseline uses Qwen3 attention
with the target's (Hq, Hkv, D)). Unlike the target's attention, these modules never write the pool
themselves: they return the K/V they computed, and the drafter decides what to store.

Legend: N rows, T query positions (K for a block), S context keys, H hidden, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from hspec.drafters.common import DrafterConfig, attend_block
from hspec.models.layers import QKVProjection, RMSNorm, SwiGLU, apply_rope

KV = tuple[torch.Tensor, torch.Tensor]


class DraftAttention(nn.Module):
    """Attention of T query positions over [context K/V ; their own K/V], Qwen3-style.

    q/k/v projections from `in_features` (H, or 2H for P-Eagle's fused first layer) to the target's
    (Hq, Hkv, D), per-head q/k RMSNorm, the target's RoPE; `causal` masks later positions among the T
    (P-Eagle), otherwise the T positions see each other (a DFlash block).
    """

    def __init__(self, config: DrafterConfig, causal: bool, in_features: int | None = None) -> None:
        super().__init__()
        c = config
        self.causal = causal
        self.qkv = QKVProjection(in_features or c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                 bias=False, qk_norm=True, eps=c.rms_norm_eps)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """K/V of inputs x (N, T, in) at the positions of cos/sin (N, T, D): k post-norm and post-RoPE.

        This is how a DFlash layer turns the fused context c_t into its drafter-side cache entries;
        the block's own K/V go through the same projections inside `forward`.
        """
        qkv = self.qkv
        n, t, _ = x.shape
        k = qkv.k_proj(x).view(n, t, qkv.num_kv_heads, qkv.head_dim)  # (N, T, Hkv, D)
        v = qkv.v_proj(x).view(n, t, qkv.num_kv_heads, qkv.head_dim)  # (N, T, Hkv, D)
        if qkv.k_norm is not None:
            k = qkv.k_norm(k)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: KV | None,
                context_mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        """x (N, T, in); cos/sin (N, T, D); context (k, v) each (N, S, Hkv, D) + mask (N, S), or None.

        Returns the output (N, T, H) and the T positions' own (k, v), each (N, T, Hkv, D).
        """
        q, k, v = self.qkv(x, cos, sin)  # (N, T, Hq, D), (N, T, Hkv, D) x2
        out = attend_block(q, k, v, context, context_mask, self.causal)  # (N, T, Hq*D)
        return self.o_proj(out), (k, v)


class DraftLayer(nn.Module):
    """Pre-norm residual attention -> SwiGLU MLP with the target's dims (a Qwen3 decoder layer)."""

    def __init__(self, config: DrafterConfig, causal: bool) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = DraftAttention(config, causal)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = SwiGLU(H, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: KV | None,
                context_mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        """x (N, T, H) -> (N, T, H) and the T positions' own (k, v) (see `DraftAttention.forward`)."""
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, context, context_mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv
