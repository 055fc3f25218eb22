"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, GQA attention, SwiGLU.

Legend: B batch, T new tokens, S context length (keys), H hidden, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as the reference models do), scaled by a weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for `positions` (B, T): each (B, T, D), angles computed in fp32."""
    angles = positions.float()[..., None] * inv_freq.float()  # (B, T, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (B, T, D): halves rotate together
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, T, heads, D) by position; cos/sin are (B, T, D). Half-split convention (HF Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)).

    After `fuse_projections` (inference only) gate and up run as one (2I, H) matmul whose halves are
    the two weights: one GEMM reads the input once and pays one dispatch instead of two.
    """

    gate_up_weight: torch.Tensor | None

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # (2I, H) once fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)  # (..., I) each
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QKVProjection(nn.Module):
    """q/k/v projections with optional bias (Qwen2) and per-head q/k RMSNorm (Qwen3), then RoPE.

    After `fuse_projections` (inference only) q, k and v come out of one matmul with the three weights
    stacked, which costs one GEMM dispatch instead of three and reads the input once.

    Shared by the target's attention and the drafters' attention modules, which use the target's
    (Hq, Hkv, D) so that their queries can read the target's own K/V.
    """

    qkv_weight: torch.Tensor | None
    qkv_bias: torch.Tensor | None

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, qk_norm: bool, eps: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        # ((Hq + 2 Hkv) D, H) weight and bias once `fuse_projections` ran (inference only).
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, H) -> q (B, T, Hq, D), k and v (B, T, Hkv, D); q and k rotated."""
        b, t, _ = x.shape
        if self.qkv_weight is not None:
            q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split((q_width, kv_width, kv_width), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention with GQA.

    q (B, T, Hq, D); k, v (B, S, Hkv, D); mask (B, 1, T, S) bool, True = may attend, or None for
    full attention. Returns (B, T, Hq * D).
    """
    b, t, hq, d = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        enable_gqa=hq != k.shape[2],
    )  # (B, Hq, T, D)
    return out.transpose(1, 2).reshape(b, t, hq * d)
