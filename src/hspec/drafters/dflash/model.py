"""The DFlash-family block drafters: `dflash`, `dspark` and `dflash-kvreuse` (docs/design.md#dflash-family).

Forward over a block [x0, MASK x (K-1)] at positions p..p+K-1 (all K slots in parallel):
1. x = embed(block) with the target's frozen embedding (MASK: the learned mask embedding);
2. 5 Qwen3-style layers; layer i's queries attend to [its context K/V (positions < p, within the
   2,048-token window) ; the block's own K/V], bidirectional inside the block, RoPE at p..p+K-1;
3. final RMSNorm -> the target's frozen LM head restricted to the pruned vocabulary: U_k;
4. (`dspark` only, in `NeuralDrafter`) the Markov head corrects U_k with the previous draft token.

Where layer i's context K/V come from is what separates the kinds:
- `dflash` / `dspark`: the drafter's own cache. Every committed position t gets the fused context
  c_t = RMSNorm(W_fc · concat_5(h_t)) and, per layer, k_t = RoPE(k_norm(W_k c_t)), v_t = W_v c_t,
  written into the pool's drafter layers by `commit` for every newly committed token (the prompt's
  positions at prefill, x0 + the accepted drafts after each verify). This per-token cache and its
  writes are the cost H-Spec removes (paper §2, Table 1).
- `dflash-kvreuse` (paper §3.1): the K/V of the i-th selected target layer, read in place; no fusion
  weights, no drafter-side cache, and no target hidden states at all.

Legend: B batch, N block rows, K block, T committed positions of one step, M committed positions of
a whole batch, S context keys, H hidden, Vp pruned vocab, Hkv KV heads, D head dim, n_sel selected
target layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hspec.cache.paged_pool import PagedKVPool
from hspec.drafters.base import DRAFTERS
from hspec.drafters.common import BlockContext, NeuralDrafter, kv_layer_of
from hspec.drafters.dflash.config import DFlashConfig
from hspec.drafters.dflash.layers import KV, DraftLayer
from hspec.models.config import TargetConfig
from hspec.models.layers import RMSNorm


def check_pool_kv_dims(kind: str, mine: TargetConfig, theirs: TargetConfig) -> None:
    """A drafter keeping its own context K/V in the pool needs the pool's (Hkv, D), i.e. the target's."""
    if (mine.num_kv_heads, mine.head_dim) != (theirs.num_kv_heads, theirs.head_dim):
        raise ValueError(f"drafter {kind!r} keeps its context K/V in the KV pool with (Hkv, D) = "
                         f"({mine.num_kv_heads}, {mine.head_dim}); the target's pool layers are (Hkv, D) = "
                         f"({theirs.num_kv_heads}, {theirs.head_dim})")


def own_pool_layers(pool: PagedKVPool, kind: str, count: int) -> list[int]:
    """Pool indices of a drafter's `count` own layers; a clear error if the pool was built without them."""
    if pool.num_drafter_layers < count:
        raise ValueError(f"drafter {kind!r} keeps {count} layers of context K/V in the pool, but the pool has "
                         f"{pool.num_drafter_layers} drafter layers; build it with num_drafter_layers="
                         f"drafter.num_drafter_layers")
    return [pool.drafter_layer_index(i) for i in range(count)]


class DFlashBackbone(NeuralDrafter):
    """The 5-layer bidirectional block backbone shared by the three kinds (not registered)."""

    config_class = DFlashConfig
    config: DFlashConfig

    def build(self) -> None:
        c = self.config
        self.layers = nn.ModuleList(DraftLayer(c, causal=False) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def block_hidden(self, ctx: BlockContext) -> torch.Tensor:
        """(N, K, H) the backbone's normalised output; ctx.context_kv holds one (k, v) per layer."""
        if len(ctx.context_kv) != len(self.layers):
            raise ValueError(f"{self.kind!r} reads one context K/V per layer ({len(self.layers)}), "
                             f"got {len(ctx.context_kv)}")
        x = self.embed_block(ctx.block_tokens)  # (N, K, H)
        cos, sin = self.rope(ctx.positions, x.dtype)  # (N, K, D) each
        for layer, context in zip(self.layers, ctx.context_kv):
            x, _ = layer(x, cos, sin, context, ctx.context_mask)  # the block's own K/V are transient
        return self.norm(x)

    def block_logits(self, ctx: BlockContext) -> torch.Tensor:
        """(N, K, Vp) backbone logits."""
        return self.head(self.block_hidden(ctx))


@DRAFTERS.register("dflash")
class DFlashDrafter(DFlashBackbone):
    """DFlash: fused target context projected into a drafter-side KV cache kept in the pool."""

    vllm_method = "dflash"  # vLLM's DFlash proposer runs the export (integrations/vllm/export.py)
    llama_cpp_arch = "dflash"  # llama.cpp's DFlash drafter runs the GGUF export (integrations/llama_cpp/)

    def __init__(self, target_config: TargetConfig, target_model: nn.Module | None = None,
                 config: DFlashConfig | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(target_config, target_model, config, device, dtype)
        self.num_drafter_layers = self.config.num_layers  # one drafter pool layer per drafter layer

    def build(self) -> None:
        super().build()
        c = self.config
        self.fc = nn.Linear(len(c.target_layers) * c.hidden_size, c.hidden_size, bias=False)  # W_fc
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def check_target(self, config: TargetConfig) -> None:
        super().check_target(config)
        check_pool_kv_dims(self.kind, self.config.target, config)

    def context_pool_layers(self, pool: PagedKVPool) -> list[int]:
        return own_pool_layers(pool, self.kind, self.config.num_layers)

    def fused_context(self, hidden: torch.Tensor) -> torch.Tensor:
        """c_t = RMSNorm(W_fc · concat_5(h_t)): hidden (N, S, n_sel, H) -> (N, S, H)."""
        return self.hidden_norm(self.fc(hidden.flatten(-2).to(self.hidden_norm.weight.dtype)))  # fc may hold int8

    def context_kv_from_hidden(self, hidden: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Drafter context K/V of positions (N or 1, S) from the target's hidden states there.

        hidden (N or 1, S, n_sel, H) -> per layer (k, v), each (N or 1, S, Hkv, D), k post-RoPE. Used by
        `commit` (what it writes to the pool) and by training (from a whole sequence, with gradients).
        """
        if hidden.dim() != 4 or hidden.shape[:2] != positions.shape or hidden.shape[2] != len(self.target_layers):
            raise ValueError(f"hidden must be (N, S, {len(self.target_layers)}, H) with positions (N, S); got "
                             f"{tuple(hidden.shape)} and {tuple(positions.shape)}")
        c = self.fused_context(hidden)  # (N, S, H)
        cos, sin = self.rope(positions, c.dtype)  # (N, S, D) each
        return [layer.self_attn.project_kv(c, cos, sin) for layer in self.layers]

    def context_kv_from_features(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                                 target_kv: dict[int, KV]) -> list[KV]:
        """Training reads the drafter's own context K/V, computed from the hidden states (with gradients)."""
        return self.context_kv_from_hidden(hidden, positions)

    def commit(self, pool: PagedKVPool, seq_ids: Sequence[int], hidden: torch.Tensor | None,
               num_committed: torch.Tensor) -> None:
        """Keep last_hidden (base class), then write every newly committed position's drafter K/V."""
        super().commit(pool, seq_ids, hidden, num_committed)
        assert hidden is not None  # the base class raised otherwise
        layers = own_pool_layers(pool, self.kind, self.config.num_layers)
        counts = num_committed.tolist()  # one small sync: the rows are ragged
        lengths = pool.lengths(seq_ids)
        device = hidden.device
        t = hidden.shape[1]
        starts = torch.tensor([length - n for length, n in zip(lengths, counts)], device=device)  # (B,)
        offsets = torch.arange(t, device=device)
        positions = starts[:, None] + offsets  # (B, T) positions of the processed tokens
        valid = offsets[None, :] < torch.tensor(counts, device=device)[:, None]  # (B, T) committed ones
        table = pool.slot_table(seq_ids)
        slots = table.slots.gather(1, positions.clamp(max=table.slots.shape[1] - 1))  # (B, T)
        # Only the committed positions, flattened over the batch into one row of M.
        kv = self.context_kv_from_hidden(hidden[valid][None], positions[valid][None])  # (1, M, Hkv, D) x2 each
        for layer, (k, v) in zip(layers, kv):
            pool.write(layer, slots[valid][None], k, v)


@DRAFTERS.register("dspark")
class DSparkDrafter(DFlashDrafter):
    """DSpark (the paper's strongest baseline): DFlash + the Markov head (rank 256)."""

    llama_cpp_arch = "dflash"  # llama.cpp chains the Markov head per slot (its draft-dspark type)


@DRAFTERS.register("dflash-kvreuse")
class DFlashKVReuse(DFlashBackbone):
    """DFlash + direct target-KV reuse (paper §3.1): layer i reads selected target layer i's K/V."""

    def __init__(self, target_config: TargetConfig, target_model: nn.Module | None = None,
                 config: DFlashConfig | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(target_config, target_model, config, device, dtype)
        # The target's K/V are all it reads: no hidden states, so nothing is kept per sequence.
        self.target_layers = ()

    def reused_kv_layers(self) -> list[int]:
        return [kv_layer_of(layer) for layer in self.config.target_layers]

    def commit(self, pool: PagedKVPool, seq_ids: Sequence[int], hidden: torch.Tensor | None,
               num_committed: torch.Tensor) -> None:
        """Nothing to keep: the target wrote the K/V this drafter reads."""

    def last_hidden_of(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """(B, 0, H): this kind keeps no hidden states."""
        weight = self.mask_embedding
        return weight.new_zeros((len(seq_ids), 0, self.config.hidden_size))
