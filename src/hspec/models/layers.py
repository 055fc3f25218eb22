"""Building blocks of a Llama-family decoder: linear products, RMSNorm, rotary embedding, GQA attention, SwiGLU.

Legend: B batch, T new tokens, S context length (keys), H hidden, Hq/Hkv heads, D head dim.

Row invariance. Greedy speculative decoding is lossless only if a token's logits come out the same
whether the target computes it alone (a 1-token decode) or as one row of a (K+1)-token verify. In
float32 the kernels' rounding differences stay far below a logit gap. In bfloat16 on the CPU they do
not: every op rounds to 8 bits of mantissa, and 4 of 62 greedy choices flipped between the two paths
(docs/fast-path.md). So, for reduced-precision CPU tensors, every op here computes a row the same way
however many rows share the call: a linear product through its weight format (`models.formats`: at most
`ROW_BLOCK` rows per product, each format's kernel giving a row its bits alone), and `attend` with
products whose reduction length does not depend on how many keys the other rows see (fixed-size key
chunks). A prompt's prefill, which plain and speculative decoding share, need not keep a decode's bits, so
each module has a second entry point for it (`Linear.prefill`, `SwiGLU.prefill`, `QKVProjection.prefill`,
`attend_prefill`): its linear products run in one floating call and its attention in one product per KV
head. Float32 and GPU tensors take the fused kernels (`F.linear`, `F.scaled_dot_product_attention`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hspec.cache.paged_pool import widened
from hspec.models.formats.base import ROW_BLOCK as _ROW_BLOCK
from hspec.models.formats.base import WeightFormat, row_invariant
from hspec.models.formats.floating import FLOATING

# Keys per product in the row-invariant attention: a query's weighted sum of values is accumulated chunk
# by chunk in fp32, so the keys that other rows of a verify add at the end never change how the earlier
# keys are summed. 1,024 rather than 256: each product costs ~40 us however small, and oneDNN's bf16
# product gave a verify row its decode's bits with chunks up to 8,192 keys (contexts to 3,100; 256 -> 1,024
# made a decode at context 800 0.78-0.90x as long; docs/fast-path.md).
_VALUE_CHUNK = 1024
# The same in float32 (a CPU target's pool, `TargetModel.kv_dtype`): MKL's fp32 product over more keys than
# some threshold rounds otherwise than over the same keys followed by zero-weight ones. On the AMX Xeon
# the threshold was ~352 keys (107 of 128 widths to 2,048 parted; none within 256); on an AVX2-only EPYC
# (Zen 3) 224: a chunk of 224 or 256 keys parted from its first 128-224 keys with zero weights after them,
# one of 192 never did (softmax weights, 4-32 rows, every width a multiple of 32). 128 leaves a margin.
_FP32_VALUE_CHUNK = 128
# Query tokens per block of a long call (a prefill): each block is computed only against the keys some
# row of it can see, so a causal prefill of T tokens does about half the T x T work and its scores stay
# cache-sized. A block is a row-invariant call of its own, so every row keeps its bits.
_QUERY_BLOCK = 128
# The weighted sum of values reduces over a multiple of this many keys (zero weights pad the rest). On an
# AVX2-only CPU torch's bf16 product over a key count that is not a multiple of 16 sometimes rounds
# otherwise than over the same keys followed by zero-weight ones (7 of 8,192 random cases here, 0 once
# both are padded to a multiple of 16): a tree row, whose table ends earlier than its siblings', and a
# verify row, whose call holds up to K masked keys more than its decode's, then parted from the decode's
# bits. On an AMX CPU (Sapphire Rapids, where oneDNN's bf16 product runs on AMX tiles, 32 bf16 values
# deep) 5 of 399 key counts did, and greedy n-gram speculation changed a Spec-Bench output; padded to 16,
# 3 verify rows of 3,192 still did; padded to 32, none (docs/fast-path.md). 32 is a multiple of 16, so
# it serves the AVX2 CPUs too; AVX-512 CPUs without AMX gave the same bits either way. The score product
# runs over the same padded count (a key's score is a product over D alone, the same bits whatever other
# keys share the call): a new product shape costs oneDNN ~0.7 ms to create, so shapes that change every 32
# tokens rather than every token save that on most decoded tokens (`key_multiple`).
_KEY_MULTIPLE = 32
# Fewest query rows one attention product gets. On an AVX2-only EPYC (Zen 3) MKL's fp32 product of 1-3
# rows runs another kernel than one of 4 to 32 rows and rounds otherwise (softmax weights times values over
# 32-256 keys, 1 and 2 threads): a decode's 3 query rows of a SmolLM2 KV head parted from its verify rows'
# bits. So a smaller block is computed as the first rows of 4 (zero rows pad it; a product of 4 rows costs
# what one of 3 does, both read the keys once). oneDNN's bf16 product gives 2 to 32 rows the same bits.
_MIN_ATTENTION_ROWS = 4


class Linear(nn.Linear):
    """`nn.Linear` whose product is its weight format's (`models.formats`; same parameters and checkpoint keys).

    weight_format: how the tensors below are stored and multiplied, set once at load (`formats.store`);
    `FLOATING` until then. weight: (out, in), floating or as the format stores it (int8 rows, an int4
    weight's floating values). weight_scale: the format's scales, or None for a floating weight.
    weight_packed: the copy the format's kernel reads (oneDNN's bf16 copy, int4 levels, w4a8 tiles, an int8
    kernel's matrix), or None. The native stack and the native drafter read these four names.
    """

    weight_scale: torch.Tensor | None
    weight_packed: torch.Tensor | None
    weight_format: WeightFormat

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.register_buffer("weight_scale", None, persistent=False)
        self.register_buffer("weight_packed", None, persistent=False)
        self.weight_format = FLOATING

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out), each row with the bits it has alone (a decode's or a verify's rows)."""
        return self.weight_format(x, self.weight, self.bias, self.weight_scale, self.weight_packed)

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` for a prompt's rows: one product for all of them (`WeightFormat.prefill`, other bits)."""
        return self.weight_format.prefill(x, self.weight, self.bias, self.weight_scale, self.weight_packed)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as the reference models do), scaled by a weight.

    Without autograd a bf16 input goes to `F.rms_norm` as it is: the CPU kernel accumulates in fp32 and
    rounds once, the same bits as casting to fp32 first (checked in the tests), without the two casts
    (~3 us of ~14 per call, 61 calls per SmolLM2 forward). Training keeps the explicit fp32 path.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # bf16 rows without autograd go to hspec's kernel (`torch.ops.hspec.rms_norm`, models/cpu_kernels.cpp):
        # F.rms_norm's steps in a loop, ~1 us a row where F.rms_norm took ~40 us on an AVX2 CPU
        # (docs/fast-path.md#hspecs-cpu-kernels). It may round otherwise than F.rms_norm in the last bit, so a
        # model uses one or the other throughout (`loading.build_model` sets it).
        self.kernel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not torch.is_grad_enabled():
            if self.kernel and self.weight.dtype == torch.bfloat16:
                return torch.ops.hspec.rms_norm(x, self.weight, self.eps)
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # x / sqrt(mean(x^2) + eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables for `positions` (B, T): each (B, T, D), angles computed in fp32.

    The sin table carries the sign of the half rotation: -sin on the first half, sin on the second, so
    `apply_rope` swaps x's halves instead of negating one (the same bits: (-a) * s == a * (-s))."""
    angles = positions.float()[..., None] * inv_freq.float()  # (B, T, D/2)
    sin = angles.sin()
    return torch.cat((angles, angles), dim=-1).cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, T, heads, D) by position: x * cos + (x2, x1) * sin with the signed sin of `rope_cos_sin`
    (half-split convention, HF Llama's x * cos + (-x2, x1) * sin). cos/sin are (B, T, D), or (B, T, 1, D)
    already broadcast over the heads (the target does that once per forward rather than once per layer)."""
    swapped = x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)  # (..., D): halves swapped
    if cos.dim() == 3:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + swapped * sin


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)).

    After `fuse_projections` (inference only) gate and up run as one (2I, H) matmul whose halves are
    the two weights: one GEMM reads the input once and pays one dispatch instead of two.
    """

    gate_up_weight: torch.Tensor | None
    gate_up_scale: torch.Tensor | None
    gate_up_packed: torch.Tensor | None
    gate_up_format: WeightFormat

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inner, bias=False)
        self.up_proj = Linear(hidden, inner, bias=False)
        self.down_proj = Linear(inner, hidden, bias=False)
        # The stacked (2I, H) matrix once fused, stored as `Linear`'s weight is (see there).
        self.register_buffer("gate_up_weight", None, persistent=False)
        self.register_buffer("gate_up_scale", None, persistent=False)
        self.register_buffer("gate_up_packed", None, persistent=False)
        self.gate_up_format = FLOATING

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., H) -> (..., H) for a decode's or a verify's rows (`Linear.forward`)."""
        if self.gate_up_weight is not None:
            return self.down_proj(self._gated(self.gate_up_format, x))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` for a prompt's rows (`Linear.prefill`)."""
        if self.gate_up_weight is not None:
            return self.down_proj.prefill(self._gated(self.gate_up_format.prefill, x))
        return self.down_proj.prefill(F.silu(self.gate_proj.prefill(x)) * self.up_proj.prefill(x))

    def _gated(self, product: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up, (..., I), from the fused (2I, H) weight multiplied by `product`."""
        gate, up = product(x, self.gate_up_weight, None, self.gate_up_scale,
                           self.gate_up_packed).chunk(2, dim=-1)  # (..., I) each
        return F.silu(gate) * up


class QKVProjection(nn.Module):
    """q/k/v projections with optional bias (Qwen2) and per-head q/k RMSNorm (Qwen3), then RoPE.

    After `fuse_projections` (inference only) q, k and v come out of one matmul with the three weights
    stacked, which costs one GEMM dispatch instead of three and reads the input once.

    Shared by the target's attention and the drafters' attention modules, which use the target's
    (Hq, Hkv, D) so that their queries can read the target's own K/V.
    """

    qkv_weight: torch.Tensor | None
    qkv_bias: torch.Tensor | None
    qkv_scale: torch.Tensor | None
    qkv_packed: torch.Tensor | None
    qkv_format: WeightFormat

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, qk_norm: bool, eps: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        # ((Hq + 2 Hkv) D, H) weight and bias once `fuse_projections` ran (inference only), stored as
        # `Linear`'s weight is (see there).
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.register_buffer("qkv_scale", None, persistent=False)
        self.register_buffer("qkv_packed", None, persistent=False)
        self.qkv_format = FLOATING

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, H) -> q (B, T, Hq, D), k and v (B, T, Hkv, D), q and k rotated, for a decode's or a verify's
        rows (`Linear.forward`)."""
        return self._project(x, cos, sin, self.qkv_format, nn.Module.__call__)

    def prefill(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` for a prompt's rows (`Linear.prefill`)."""
        return self._project(x, cos, sin, self.qkv_format.prefill, Linear.prefill)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, product: Callable[..., torch.Tensor],
                 linear: Callable[[Linear, torch.Tensor], torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward`, the fused weight multiplied by `product`, the separate ones by `linear`."""
        b, t, _ = x.shape
        if self.qkv_weight is not None:
            q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            qkv = product(x, self.qkv_weight, self.qkv_bias, self.qkv_scale, self.qkv_packed)  # (B, T, (Hq + 2 Hkv) D)
            if self.q_norm is None:  # q and k are adjacent heads of one tensor: rotate them in one pass
                qk = apply_rope(qkv[..., : q_width + kv_width].view(b, t, -1, self.head_dim), cos, sin)
                q, k = qk.split((self.num_heads, self.num_kv_heads), dim=2)
                return q, k, qkv[..., q_width + kv_width :].view(b, t, self.num_kv_heads, self.head_dim)
            q, k, v = qkv.split((q_width, kv_width, kv_width), dim=-1)
        else:
            q, k, v = linear(self.q_proj, x), linear(self.k_proj, x), linear(self.v_proj, x)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           num_keys: int | None = None, kernel: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with GQA.

    q (B, T, Hq, D); k, v (B, S', Hkv, D) whose first S = num_keys (default S') positions are the keys;
    mask (B, 1, T, S) bool, True = may attend, or None for full attention. Returns (B, T, Hq * D).
    Positions after the S keys must hold finite values and are never attended: a paged read may add them
    (`key_multiple`). Row-invariant tensors take `_attend_row_invariant`.
    kernel: the model attends with hspec's kernel over its pool, float32 or bfloat16 (`TargetModel.kv_dtype`):
    a decode's or a verify's row-invariant rows go to `torch.ops.hspec.attention` (models/cpu_kernels.cpp),
    which widens each key and value to fp32 as it reads it, computes each row alone and skips the keys it may
    not see: one call where `_attend_row_invariant` makes ~25 (docs/fast-path.md#hspecs-cpu-kernels). A model
    uses the kernel for every decode and verify or for none (`loading.build_model` decides).
    """
    s = k.shape[1] if num_keys is None else num_keys
    if row_invariant(q):
        if kernel and k.dtype in (torch.float32, torch.bfloat16):
            return torch.ops.hspec.attention(q, k, v, mask, s)
        return _attend_row_invariant(q, k, v, mask, s, _ROW_BLOCK)
    return _attend_fused(q, k, v, mask, s)


def attend_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   num_keys: int | None = None, kernel: bool = False) -> torch.Tensor:
    """`attend` for a prompt's rows (see the module doc): a query block's rows of a KV head share one product
    (other bits than a decode's); shapes as in `attend`. kernel: as in `attend`; a prompt's rows then take
    `_attend_row_invariant` over the keys widened to float32, so a bf16 pool gives them the fp32 pool's
    products and bits."""
    s = k.shape[1] if num_keys is None else num_keys
    if row_invariant(q):
        if kernel and k.dtype == torch.bfloat16:
            k, v = widened(k), widened(v)
        return _attend_row_invariant(q, k, v, mask, s, q.shape[1] * q.shape[2])
    return _attend_fused(q, k, v, mask, s)


def _attend_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, s: int
                  ) -> torch.Tensor:
    """`attend` by torch's fused kernel (float32 and GPU tensors)."""
    b, t, hq, d = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k[:, :s].transpose(1, 2), v[:, :s].transpose(1, 2), attn_mask=mask,
        enable_gqa=hq != k.shape[2],
    )  # (B, Hq, T, D)
    return out.transpose(1, 2).reshape(b, t, hq * d)


def key_multiple(x: torch.Tensor) -> int:
    """How many key positions a reader should hand `attend` for queries like `x`: `attend` computes a
    row-invariant tensor's products over the keys rounded up to `_KEY_MULTIPLE` (see there), so keys and
    values given that far (`PagedKVPool.gather(multiple=...)`) spare it a copy of the values, and oneDNN
    sees a new product shape every 32 tokens rather than every token (creating one cost ~0.7 ms on an AMX
    CPU, once per decoded token; docs/fast-path.md). 1 for the fused kernels."""
    return _KEY_MULTIPLE if row_invariant(x) else 1


def _attend_row_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          s: int, row_block: int) -> torch.Tensor:
    """`attend` computed so that a query row's output does not depend on the other rows of the call.

    The G = Hq / Hkv query heads that share a KV head become G * T rows, multiplied per KV head in
    products of at most `row_block` rows (`_ROW_BLOCK`; a prompt's prefill: all in one).
    Scores are a bf16 product over D (as the eager attention of reference implementations computes
    them) scaled and softmaxed in fp32; the weighted sum of values is accumulated in fp32 over chunks
    of `_VALUE_CHUNK` keys. Keys a row may not see get weight exactly 0, so a verify row, whose call
    holds up to K more keys, sums the same numbers in the same order as the 1-token decode did.

    A call of more than `_QUERY_BLOCK` tokens under a mask runs block by block, each block against the
    keys up to the last one any of its rows sees: the keys it drops all have weight 0 for every row.
    """
    t = q.shape[1]
    if mask is None or t <= _QUERY_BLOCK:
        return _attend_rows(q, k, v, mask, s, row_block)
    blocks = []
    for start in range(0, t, _QUERY_BLOCK):
        block_mask = mask[:, :, start : start + _QUERY_BLOCK]  # (B, 1, Tb, S)
        seen = block_mask.flatten(0, 2).any(0).nonzero()  # (visible keys, 1)
        keys = int(seen[-1]) + 1 if seen.numel() else 1
        blocks.append(_attend_rows(q[:, start : start + _QUERY_BLOCK], k, v, block_mask[..., :keys], keys,
                                   row_block))
    return torch.cat(blocks, dim=1)


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, s: int,
                 row_block: int = _ROW_BLOCK) -> torch.Tensor:
    """`_attend_row_invariant` in one call: every row against the first s keys (shapes as in `attend`),
    the T G query rows of a KV head in products of at most `row_block` rows. The products run over W, s
    rounded up to `_KEY_MULTIPLE`: over the positions k and v hold up to W when they reach it (their
    weights are 0), else over s keys and values padded by zeros."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    width = s + -s % _KEY_MULTIPLE
    rows = q.view(b, t, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)  # (B, Hkv, T G, D)
    visible = None
    if mask is not None:
        visible = mask[:, :, :, None, :].expand(b, 1, t, g, s).reshape(b, 1, t * g, s)
    # Both products run over W keys, K^T row-major: MKL's fp32 score product, unlike oneDNN's bf16 one,
    # rounds a key's score otherwise over a key count that is not a multiple of 32 or from a K^T that is not
    # row-major. Keys and values not given that far are padded with zeros here (a copy); a CPU target's pool
    # gives them (`key_multiple`), K^T already row-major.
    if k.shape[1] < width:
        keys = F.pad(k[:, :s].permute(0, 2, 3, 1), (0, width - s))  # (B, Hkv, D, W)
        values = F.pad(v[:, :s].permute(0, 2, 1, 3), (0, 0, 0, width - s))  # (B, Hkv, W, D)
    else:
        if k.shape[1] > width:
            k, v = k[:, :width], v[:, :width]
        keys, values = k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3)  # (B, Hkv, D, W), (B, Hkv, W, D)
    if t * g <= row_block:  # one product (a decode, a short verify): no slicing, which costs a dispatch
        out = _attend_block(rows, keys, values, s, visible)  # (B, Hkv, T G, D)
    else:
        out = torch.cat([_attend_block(rows[:, :, start : start + row_block], keys, values, s,
                                       None if visible is None else visible[:, :, start : start + row_block])
                         for start in range(0, t * g, row_block)], dim=2)
    return out.view(b, hkv, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, hq * d)


def _attend_block(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, s: int,
                  visible: torch.Tensor | None) -> torch.Tensor:
    """Up to `_ROW_BLOCK` query rows (B, Hkv, R, D) against the first s of keys (B, Hkv, D, W) and
    values (B, Hkv, W, D), W >= s a multiple of `_KEY_MULTIPLE` whose positions after s weigh 0;
    visible (B, 1, R, s) or None. Returns (B, Hkv, R, D) in the rows' dtype.

    Keys and values in float32 (a target's pool on the CPU, `TargetModel.kv_dtype`) make both products
    fp32 GEMMs of the rows and weights in fp32; in the rows' dtype they are that dtype's products (oneDNN's
    for bf16), the weights rounded to it. Either way the fp32 sum over value chunks is the same."""
    r, d = rows.shape[2], rows.shape[3]
    if r < _MIN_ATTENTION_ROWS:  # as the first rows of a larger product (see `_MIN_ATTENTION_ROWS`)
        rows = F.pad(rows, (0, 0, 0, _MIN_ATTENTION_ROWS - r))
        visible = None if visible is None else F.pad(visible, (0, 0, 0, _MIN_ATTENTION_ROWS - r), value=True)
    scores = torch.matmul(rows.to(keys.dtype), keys)  # (B, Hkv, rows, W): a key's score is its own product
    if scores.shape[-1] > s:
        scores = scores[..., :s]
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    weights = torch.softmax(scores.float() * d**-0.5, dim=-1).to(values.dtype)
    width = values.shape[2]
    if width > s:
        weights = F.pad(weights, (0, width - s))
    chunk = _FP32_VALUE_CHUNK if values.dtype == torch.float32 else _VALUE_CHUNK
    if width <= chunk:  # one chunk: its product as it is (a cast to fp32 and back is exact)
        out = torch.matmul(weights, values)
    else:
        out = torch.matmul(weights[..., :chunk], values[:, :, :chunk]).float()
        for start in range(chunk, width, chunk):
            out = out + torch.matmul(weights[..., start : start + chunk], values[:, :, start : start + chunk]).float()
    out = out.to(rows.dtype)
    return out if out.shape[2] == r else out[:, :, :r]
