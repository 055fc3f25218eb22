"""The H-Spec drafter: a hybrid Mamba-2 + attention block drafter with no drafter-side KV cache.

Target context comes in two ways (paper §3.2-3.3, docs/design.md#h-spec):
* the hidden states of the 5 selected target layers at the last verified position p-1, fused and
  projected once per step into S_init = reshape(Proj_dS(Proj_r(concat_5(h))), [nheads, P, N]), the
  initial SSM state of every Mamba-2 scan over the block (shared by all Mamba modules);
* the target's own K/V, read in place from the KV pool by the attention modules (module i reads
  the i-th of the last n_attn selected layers), within a 2,048-token sliding window.

Forward over a block of K positions (all in parallel):
1. x = embed([x0, MASK, ...]) with the target's frozen embedding (MASK: the learned mask embedding);
2. per layer, residual pre-norm modules: Mamba-2 from S_init -> attention over [target K/V ; block
   K/V], causal in the block, RoPE at p..p+K-1 -> SwiGLU MLP (the partial layer has no attention);
3. final RMSNorm -> the target's frozen LM head restricted to the pruned vocabulary: U_k;
4. (in `NeuralDrafter`) the Markov head corrects U_k with the previous draft token.

The ablation kinds (paper §4.3, B.4) are presets of this class: another `HSpecConfig` (config.py:PRESETS).
Nothing here grows with the context: per sequence, only last_hidden (n_sel, H) is kept.

Legend: N block rows, K block, S context keys, H hidden, Vp pruned vocab, P SSM head dim, n_sel
selected target layers.
"""

from __future__ import annotations

import torch
from torch import nn

from hspec.drafters.base import DRAFTERS
from hspec.drafters.common import BlockAttention, BlockContext, NeuralDrafter, kv_layer_of
from hspec.drafters.hspec.config import HSPEC, PRESETS, HSpecConfig
from hspec.models.layers import RMSNorm, SwiGLU
from hspec.ssm.mixer import Mamba2Mixer


class StateInjection(nn.Module):
    """S_init = reshape(Proj_dS(Proj_r(concat(h))), [nheads, P, N]) (paper §3.3.1, B.1: r = H)."""

    def __init__(self, config: HSpecConfig) -> None:
        super().__init__()
        self.shape = (config.mamba_nheads, config.mamba_headdim, config.mamba_d_state)
        self.proj_r = nn.Linear(len(config.target_layers) * config.hidden_size, config.fusion_rank, bias=False)
        self.proj_ds = nn.Linear(config.fusion_rank, config.state_size, bias=False)

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """last_hidden (N, n_sel, H) -> S_init (N, nheads, P, N_state)."""
        fused = self.proj_r(last_hidden.flatten(1))  # (N, r)
        return self.proj_ds(fused).view(-1, *self.shape)  # (N, nheads, P, N_state)


class HSpecLayer(nn.Module):
    """One drafter layer: residual pre-norm [Mamba-2] -> [attention] -> SwiGLU MLP."""

    def __init__(self, config: HSpecConfig, layout: str) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.mamba_norm = RMSNorm(H, eps) if "mamba" in layout else None
        self.mamba = Mamba2Mixer(config.mamba_config()) if "mamba" in layout else None
        self.attn_norm = RMSNorm(H, eps) if "attention" in layout else None
        self.attn = BlockAttention(config, causal=True) if "attention" in layout else None
        self.mlp_norm = RMSNorm(H, eps)
        self.mlp = SwiGLU(H, config.intermediate_size)

    def forward(self, x: torch.Tensor, s_init: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor] | None, context_mask: torch.Tensor | None
                ) -> torch.Tensor:
        """x (N, K, H); s_init (N, nheads, P, N_state) or None (zero state); returns (N, K, H)."""
        if self.mamba is not None and self.mamba_norm is not None:
            mixed, _ = self.mamba(self.mamba_norm(x), s_init)  # the block's final SSM state is dropped
            x = x + mixed
        if self.attn is not None and self.attn_norm is not None:
            attended, _ = self.attn(self.attn_norm(x), cos, sin, context, context_mask)  # own K/V: transient
            x = x + attended
        return x + self.mlp(self.mlp_norm(x))


@DRAFTERS.register(HSPEC, presets=PRESETS)
class HSpecDrafter(NeuralDrafter):
    """H-Spec (paper §3.3): 3 Mamba-attention-MLP layers + 1 Mamba-MLP layer + Markov head; each ablation
    (paper §4.3, B.4) is a preset of it, the same class built from another `HSpecConfig` (`PRESETS`)."""

    config_class = HSpecConfig
    config: HSpecConfig

    def build(self) -> None:
        c = self.config
        self.injection = StateInjection(c) if c.injects else None
        self.layers = nn.ModuleList(HSpecLayer(c, layout) for layout in c.layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def reused_kv_layers(self) -> list[int]:
        """Target decoder layers whose K/V the attention modules read in place."""
        if not self.config.attend_target:
            return []
        return [kv_layer_of(layer) for layer in self.config.attention_source_layers]

    def initial_state(self, last_hidden: torch.Tensor) -> torch.Tensor | None:
        """S_init (N, nheads, P, N_state) from last_hidden (N, n_sel, H); None (zeros) without injection."""
        return None if self.injection is None else self.injection(last_hidden)

    def block_logits(self, ctx: BlockContext) -> torch.Tensor:
        """(N, K, Vp) backbone logits for the blocks of `ctx`."""
        wanted = len(self.reused_kv_layers())
        if len(ctx.context_kv) != wanted:
            raise ValueError(f"{self.kind!r} reads {wanted} context K/V (one per attention module), "
                             f"got {len(ctx.context_kv)}")
        x = self.embed_block(ctx.block_tokens)  # (N, K, H)
        cos, sin = self.rope(ctx.positions, x.dtype)  # (N, K, D) each
        s_init = self.initial_state(ctx.last_hidden.to(x.dtype))  # computed once, shared by every scan
        attention_index = 0
        for layer in self.layers:
            context = None
            if layer.attn is not None:
                context = ctx.context_kv[attention_index] if ctx.context_kv else None
                attention_index += 1
            x = layer(x, s_init, cos, sin, context, ctx.context_mask)
        return self.head(self.norm(x))  # (N, K, Vp)
