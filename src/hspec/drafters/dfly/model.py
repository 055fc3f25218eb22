"""The DFly drafter (AngelSpec): DFlash + per-layer fusion of the tapped target layers + a
previous-token correction before the LM head (config.py has the equations).

Forward over a block [x0, MASK x (K-1)] at positions p..p+K-1:
1. context (at `commit`, for every newly committed position t): base_t = W_fc · concat(h_t), then
   per layer i, c^i_t = RMSNorm(base_t + sum_j softmax(alpha_i)_j h_{t,j}), projected by layer i's own
   W_k/W_v into the drafter-side KV cache in the pool (DFlash keeps one c_t for all layers);
2. the 5 DFlash layers over [context ; block], bidirectional inside the block, then the final norm:
   h_k (N, K, H);
3. slot by slot, h'_k = h_k + SwiGLU([RMSNorm(h_k); RMSNorm(e(prev_k))]) with prev_0 = x0 and
   prev_k = d_k (teacher-forced x_{p+k} in training), then the target's pruned LM head: l_k.

Step 3 is why drafting is sequential over the K slots (one small SwiGLU per slot), as DSpark's
Markov head is; the backbone runs once per block.

Legend: N rows, K block, S context positions, H hidden, Vp pruned vocab, n_sel tapped target layers,
I_c the correction's width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hspec.drafters.base import DRAFTERS, DraftBatch, Proposal
from hspec.drafters.block_attention import KV
from hspec.drafters.common import BlockContext
from hspec.drafters.dflash.model import DFlashDrafter
from hspec.drafters.dfly.config import DFlyConfig
from hspec.drafters.sequential import inference_context, sample_slots
from hspec.models.layers import RMSNorm


class PrevTokenCorrection(nn.Module):
    """h' = h + down(silu(gate(z)) * up(z)), z = [RMSNorm(h); RMSNorm(e_prev)]; down starts at zero."""

    def __init__(self, hidden: int, inner: int, eps: float) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(hidden, eps)
        self.embed_norm = RMSNorm(hidden, eps)
        self.gate_proj = nn.Linear(2 * hidden, inner, bias=False)
        self.up_proj = nn.Linear(2 * hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        nn.init.zeros_(self.down_proj.weight)  # an untrained correction leaves DFlash's h unchanged

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        """hidden, prev_embedding (..., H) -> (..., H)."""
        z = torch.cat([self.hidden_norm(hidden), self.embed_norm(prev_embedding.to(hidden.dtype))], -1)  # (..., 2H)
        return hidden + self.down_proj(F.silu(self.gate_proj(z)) * self.up_proj(z))


@DRAFTERS.register("dfly")
class DFlyDrafter(DFlashDrafter):
    """DFly: per-layer fused context in a drafter-side KV cache + the previous-token correction."""

    config_class = DFlyConfig
    config: DFlyConfig
    sequential_head = True  # the trainer calls `training_logits` (the correction needs the previous token)

    def build(self) -> None:
        super().build()  # DFlash: layers, final norm, W_fc and the context norm
        c = self.config
        # alpha_i: one row of mixing logits over the tapped layers per drafter layer; zero = an even mix.
        self.fusion_logits = nn.Parameter(torch.zeros(c.num_layers, len(c.target_layers)))  # (layers, n_sel)
        self.correction = PrevTokenCorrection(c.hidden_size, c.correction_width, c.rms_norm_eps)

    # ---- context -----------------------------------------------------------------------------------

    def layer_contexts(self, hidden: torch.Tensor) -> torch.Tensor:
        """c^i = RMSNorm(W_fc · concat(h) + sum_j softmax(alpha_i)_j h_j): (N, S, n_sel, H) -> (layers, N, S, H)."""
        hidden = hidden.to(self.hidden_norm.weight.dtype)  # the compute dtype (fc may hold int8)
        base = self.fc(hidden.flatten(-2))  # (N, S, H) DFlash's shared projection
        mix = torch.softmax(self.fusion_logits, dim=-1)  # (layers, n_sel)
        residual = torch.einsum("lj,nsjh->lnsh", mix, hidden)  # (layers, N, S, H)
        return self.hidden_norm(base[None] + residual)

    def context_kv_from_hidden(self, hidden: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Per layer (k, v), each (N, S, Hkv, D), of positions (N, S) from hidden (N, S, n_sel, H)."""
        if hidden.dim() != 4 or hidden.shape[:2] != positions.shape or hidden.shape[2] != len(self.target_layers):
            raise ValueError(f"hidden must be (N, S, {len(self.target_layers)}, H) with positions (N, S); got "
                             f"{tuple(hidden.shape)} and {tuple(positions.shape)}")
        contexts = self.layer_contexts(hidden)  # (layers, N, S, H)
        cos, sin = self.rope(positions, contexts.dtype)  # (N, S, D) each
        return [layer.self_attn.project_kv(c, cos, sin) for layer, c in zip(self.layers, contexts)]

    # ---- forward -----------------------------------------------------------------------------------

    def block_logits(self, ctx: BlockContext) -> torch.Tensor:
        """(N, K, Vp) logits with the correction's previous token unknown: only the backbone's h_k.

        Drafting and training always go through the correction (`teacher_forced_logits`, `propose`).
        """
        return self.head(self.block_hidden(ctx))

    def corrected_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """hidden (..., H), prev_tokens (...) target ids -> (..., Vp)."""
        prev = F.embedding(prev_tokens, self.target_parts.embed_weight)  # (..., H)
        return self.head(self.correction(hidden, prev))

    def teacher_forced_logits(self, ctx: BlockContext, prev_tokens: torch.Tensor) -> torch.Tensor:
        """(N, K, Vp) with prev = [x0, x_{p+1}, ..., x_{p+K-1}] (N, K): every slot in one pass."""
        return self.corrected_logits(self.block_hidden(ctx), prev_tokens)

    def training_logits(self, ctx: BlockContext, prev_tokens: torch.Tensor, labels: torch.Tensor,
                        valid: torch.Tensor) -> tuple[torch.Tensor, None]:
        """What the trainer's loss reads: the teacher-forced logits, and no loss of DFly's own."""
        return self.teacher_forced_logits(ctx, prev_tokens), None

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        """One backbone forward, then the correction and the draw slot by slot (module docstring)."""
        hidden = self.block_hidden(inference_context(self, batch, K))  # (B, K, H)
        local, probs, confidence = sample_slots(
            lambda k, prev: self.corrected_logits(hidden[:, k], prev), K, batch.anchor_tokens,
            self.head.to_target_ids, batch.sampling, batch.generators)
        return Proposal(self.head.to_target_ids(local), self.head.to_full(probs), confidence=confidence)
