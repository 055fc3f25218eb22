"""Attention of a draft block over context K/V plus its own K/V (re-exported by `drafters.common`).

Legend: N rows, K block, S context keys, H hidden, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from hspec.models.layers import QKVProjection

if TYPE_CHECKING:
    from hspec.drafters.common import DrafterConfig


class BlockAttention(nn.Module):
    """Attention of a draft block over context K/V plus the block's own K/V (Qwen3-style, paper B.2).

    Dimensions are the target's (Hq, Hkv, D), so the context may be the target's own cached K/V read
    in place. Queries and the block's keys/values come from this module's projections with per-head
    q/k-norm, rotated with the target's RoPE at the block positions. `causal` masks later block
    positions (H-Spec); DFlash-style blocks are bidirectional. The block's K/V are transient.
    """

    def __init__(self, config: DrafterConfig, causal: bool) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.causal = causal
        self.qkv = QKVProjection(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, bias=False,
                                 qk_norm=True, eps=c.rms_norm_eps)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor] | None, context_mask: torch.Tensor | None
                ) -> torch.Tensor:
        """x (N, K, H); cos/sin (N, K, D); context (k, v) each (N, S, Hkv, D) with context_mask (N, S),
        or None for a block that sees only itself. Returns (N, K, H)."""
        q, k, v = self.qkv(x, cos, sin)  # (N, K, Hq, D), (N, K, Hkv, D) x2
        out = attend_block(q, k, v, context, context_mask, self.causal)  # (N, K, Hq*D)
        return self.o_proj(out)


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 context: tuple[torch.Tensor, torch.Tensor] | None, context_mask: torch.Tensor | None,
                 causal: bool) -> torch.Tensor:
    """Softmax attention of the block queries over [context keys ; block keys], with GQA.

    q (N, K, Hq, D); k, v (N, K, Hkv, D); context (N, S, Hkv, D) x2 or None; context_mask (N, S) bool.
    Scores against the context and the block are computed separately and share one softmax, so the
    context K/V are read where they are (a pool view) instead of being copied next to the block's.
    Returns (N, K, Hq * D).
    """
    n, K, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    # Query head h reads KV head h // g (HF repeat_kv order): group the g heads of one KV head.
    qg = q.view(n, K, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, g * K, d)  # (N, Hkv, g*K, D)
    scale = 1.0 / math.sqrt(d)
    block_scores = (qg @ k.permute(0, 2, 3, 1)).float() * scale  # (N, Hkv, g*K, K)
    if causal:
        visible = torch.ones(K, K, dtype=torch.bool, device=q.device).tril()  # (K, K) query i sees keys <= i
        block_scores = block_scores.masked_fill(~visible.repeat(g, 1), float("-inf"))
    if context is None:
        probs = torch.softmax(block_scores, dim=-1).to(v.dtype)
        out = probs @ v.transpose(1, 2)  # (N, Hkv, g*K, D)
    else:
        ck, cv = context
        s = ck.shape[1]
        ctx_scores = (qg @ ck.permute(0, 2, 3, 1)).float() * scale  # (N, Hkv, g*K, S)
        if context_mask is not None:
            ctx_scores = ctx_scores.masked_fill(~context_mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(torch.cat([ctx_scores, block_scores], dim=-1), dim=-1).to(v.dtype)
        out = probs[..., :s] @ cv.transpose(1, 2) + probs[..., s:] @ v.transpose(1, 2)  # (N, Hkv, g*K, D)
    return out.view(n, hkv, g, K, d).permute(0, 3, 1, 2, 4).reshape(n, K, hq * d)


