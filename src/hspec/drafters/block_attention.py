"""Attention of T query positions over context K/V plus their own K/V: the one attention module of
every trained drafter (re-exported by `drafters.common`).

H-Spec's attention reads the target's cached K/V in place; the DFlash family and P-Eagle read their
own context K/V from the pool's drafter layers, and project it with `project_kv`. Either way the
module never writes the pool: it returns the K/V it computed and the drafter decides what to store.

Legend: N rows, T query positions (K for a block), S context keys, H hidden, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hspec.drafters.config import DrafterConfig
from hspec.models.layers import QKVProjection, apply_rope

KV = tuple[torch.Tensor, torch.Tensor]


class BlockAttention(nn.Module):
    """Attention of T query positions over [context K/V ; their own K/V], Qwen3-style (paper B.2).

    Dimensions are the target's (Hq, Hkv, D), so the context may be the target's own cached K/V read
    in place. q/k/v come from this module's projections of `in_features` (H, or 2H for P-Eagle's
    fused first layer) with per-head q/k RMSNorm, rotated with the target's RoPE at the query
    positions. `causal` masks later positions among the T (H-Spec, P-Eagle); otherwise the T
    positions see each other (a DFlash block). The T positions' own K/V are returned, never stored here.

    `kernel` (off unless set): attend with hspec's kernel (`hspec::block_attention`, models/cpu_kernels.cpp)
    where every row has its own context and no gradient is needed, as the native proposal does
    (drafters/hspec/native_propose.cpp): the same attention, summed in the target's attention's order instead of
    torch's products' (which in bf16 round each score to bf16); the caller loads hspec's kernels first.
    """

    def __init__(self, config: DrafterConfig, causal: bool, in_features: int | None = None) -> None:
        super().__init__()
        c = config
        self.causal = causal
        self.kernel = False
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
        """x (N, T, in); cos/sin (N, T, D); context (k, v) each (N, S, Hkv, D), or (G, S, Hkv, D) shared by
        groups of rows (`attend_block`), with context_mask (N, S), or None for positions that see only each other.

        Returns the output (N, T, H) and the T positions' own (k, v), each (N, T, Hkv, D).
        """
        q, k, v = self.qkv(x, cos, sin)  # (N, T, Hq, D), (N, T, Hkv, D) x2
        if self.kernel and context is not None and context[0].shape[0] == q.shape[0] and not torch.is_grad_enabled():
            ck, cv = context
            out = torch.ops.hspec.block_attention(q, ck, cv, context_mask, ck.shape[1], k, v, self.causal)
        else:
            out = attend_block(q, k, v, context, context_mask, self.causal)  # (N, T, Hq*D)
        return self.o_proj(out), (k, v)


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 context: tuple[torch.Tensor, torch.Tensor] | None, context_mask: torch.Tensor | None,
                 causal: bool) -> torch.Tensor:
    """Softmax attention of the block queries over [context keys ; block keys], with GQA.

    q (N, K, Hq, D); k, v (N, K, Hkv, D); context (G, S, Hkv, D) x2 or None; context_mask (N, S) bool.
    G = N gives every row its own context; G < N (G dividing N) is training's grouped form: rows
    n*N/G .. (n+1)*N/G - 1 share context n (blocks of one sequence), so a sequence's context products
    are one matrix product for all its rows instead of one small product per row over a copied context.
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
    elif context[0].shape[0] == n:  # the context may be in another dtype (a CPU target's float32 pool): its
        ck, cv = context  # products are in its dtype
        s = ck.shape[1]
        ctx_scores = (qg.to(ck.dtype) @ ck.permute(0, 2, 3, 1)).float() * scale  # (N, Hkv, g*K, S)
        if context_mask is not None:
            ctx_scores = ctx_scores.masked_fill(~context_mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(torch.cat([ctx_scores, block_scores], dim=-1), dim=-1)
        out = (probs[..., :s].to(cv.dtype) @ cv.transpose(1, 2)).to(v.dtype) \
            + probs[..., s:].to(v.dtype) @ v.transpose(1, 2)  # (N, Hkv, g*K, D)
    else:  # grouped (docstring): the A = N/G rows of a group read its context in one product
        ck, cv = context
        groups, s = ck.shape[:2]
        a = n // groups

        def by_group(t: torch.Tensor) -> torch.Tensor:  # (N, Hkv, g*K, X) -> (G, Hkv, A*g*K, X)
            return t.view(groups, a, hkv, g * K, -1).transpose(1, 2).reshape(groups, hkv, a * g * K, -1)

        def by_row(t: torch.Tensor) -> torch.Tensor:  # (G, Hkv, A*g*K, X) -> (N, Hkv, g*K, X)
            return t.view(groups, hkv, a, g * K, -1).transpose(1, 2).reshape(n, hkv, g * K, -1)

        ctx_scores = by_row((by_group(qg).to(ck.dtype) @ ck.permute(0, 2, 3, 1)).float()) * scale  # (N, Hkv, g*K, S)
        if context_mask is not None:
            ctx_scores = ctx_scores.masked_fill(~context_mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(torch.cat([ctx_scores, block_scores], dim=-1), dim=-1)
        ctx_out = by_row(by_group(probs[..., :s].to(cv.dtype)) @ cv.transpose(1, 2))  # (N, Hkv, g*K, D)
        out = ctx_out.to(v.dtype) + probs[..., s:].to(v.dtype) @ v.transpose(1, 2)  # (N, Hkv, g*K, D)
    return out.view(n, hkv, g, K, d).permute(0, 3, 1, 2, 4).reshape(n, K, hq * d)


