"""The P-Eagle drafter: EAGLE-3 made parallel with a shared learnable hidden vector (docs/design.md#p-eagle).

EAGLE pairs each token with the target feature of the position before it. Here the feature is
f = W_fc · concat_5(h) over the 5 selected layers, and the entry at position t is (x_t, h_{t-1}):

- context entries t < p: (x_t, h_{t-1}) (t = 0 has no previous position: the shared vector stands
  in), run causally through all drafter layers; every layer's K/V of every entry is kept in the
  pool's drafter layers (the drafter-side KV cache, one layer of it per drafter layer);
- the draft at positions p..p+K-1, one forward: depth 0 is (x0, h_{p-1}), the real anchor token with
  the real last feature; depths d >= 1 are (MASK, the shared learnable hidden vector), because their
  previous token and feature are not known yet. Attention is causal inside the draft; depth d predicts
  x_{p+1+d}, as slot d of every block drafter does.

The shared vector `mask_hidden` (n_sel*H) replaces the concatenated target hidden states before W_fc,
so it flows through the same projection as a real feature (as in the speculators implementation).

Writing the cache needs the committed tokens, which `commit` does not receive: `commit` queues the
features of the new positions and the next `propose` (which sees the token history) runs them through
the drafter and writes their K/V before drafting. Each committed position is processed once, as
EAGLE's "draft extend" does.

Legend: B batch, N rows, K block, T positions of one run, S context keys, H hidden, Vp pruned vocab,
Hkv KV heads, D head dim, n_sel selected target layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hspec.cache.paged_pool import PagedKVPool
from hspec.drafters.base import DRAFTERS, DraftBatch, Proposal
from hspec.drafters.block_attention import KV, BlockAttention
from hspec.drafters.common import BlockContext, NeuralDrafter
from hspec.drafters.dflash.layers import DraftLayer
from hspec.drafters.dflash.model import check_pool_kv_dims, own_pool_layers
from hspec.drafters.peagle.config import PEagleConfig
from hspec.models.config import TargetConfig
from hspec.models.layers import RMSNorm, SwiGLU


class FusedLayer(nn.Module):
    """EAGLE-3's first layer: attention over [norm(embedding) ; norm(feature)] (2H), residual = feature."""

    def __init__(self, config: PEagleConfig) -> None:
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = BlockAttention(config, causal=True, in_features=2 * H)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = SwiGLU(H, config.intermediate_size)

    def forward(self, emb: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context: KV | None, context_mask: torch.Tensor | None) -> tuple[torch.Tensor, KV]:
        """emb, feature (N, T, H) -> (N, T, H) and the T positions' own (k, v), each (N, T, Hkv, D)."""
        x_in = torch.cat([self.input_layernorm(emb), self.hidden_norm(feature)], dim=-1)  # (N, T, 2H)
        attn, kv = self.self_attn(x_in, cos, sin, context, context_mask)
        x = feature + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


@DRAFTERS.register("peagle")
class PEagleDrafter(NeuralDrafter):
    """P-Eagle: a causal EAGLE-3-style stack drafting K depths in one forward, with a context KV cache."""

    config_class = PEagleConfig
    config: PEagleConfig
    trains_with_cod = True
    vllm_method = "eagle3"  # vLLM's EAGLE-3 with parallel drafting runs the export (integrations/vllm/export.py)

    def __init__(self, target_config: TargetConfig, target_model: nn.Module | None = None,
                 config: PEagleConfig | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(target_config, target_model, config, device, dtype)
        self.num_drafter_layers = self.config.num_layers
        # seq_id -> (first position, features (T, n_sel*H)) of committed positions not yet in the cache.
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}

    def build(self) -> None:
        c = self.config
        width = len(c.target_layers) * c.hidden_size  # n_sel * H
        self.fc = nn.Linear(width, c.hidden_size, bias=False)  # W_fc
        self.mask_hidden = nn.Parameter(torch.randn(width) * 0.02)  # the shared learnable hidden vector
        self.layers = nn.ModuleList([FusedLayer(c)] + [DraftLayer(c, causal=True) for _ in range(c.num_layers - 1)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def check_target(self, config: TargetConfig) -> None:
        super().check_target(config)
        check_pool_kv_dims(self.kind, self.config.target, config)

    def context_pool_layers(self, pool: PagedKVPool) -> list[int]:
        return own_pool_layers(pool, self.kind, self.config.num_layers)

    # ---- forward ---------------------------------------------------------------------------------

    def run(self, emb: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
            context: Sequence[KV] | None, context_mask: torch.Tensor | None) -> tuple[torch.Tensor, list[KV]]:
        """Entries (emb (N, T, H), features (N, T, n_sel*H)) at positions (N, T), causal among the T.

        context: one (k, v) per layer, each (N, S, Hkv, D), visible per context_mask (N, S); or None.
        Returns the last layer's output (N, T, H) and every layer's (k, v) of the T entries.
        """
        x = self.fc(features.to(emb.dtype))  # (N, T, H) the projected target feature
        cos, sin = self.rope(positions, emb.dtype)  # (N, T, D) each
        kvs = []
        for i, layer in enumerate(self.layers):
            layer_context = context[i] if context is not None else None
            if i == 0:
                x, kv = layer(emb, x, cos, sin, layer_context, context_mask)
            else:
                x, kv = layer(x, cos, sin, layer_context, context_mask)
            kvs.append(kv)
        return x, kvs

    def block_logits(self, ctx: BlockContext) -> torch.Tensor:
        """(N, K, Vp): depth 0 = (x0, h_{p-1}), depths >= 1 = (MASK, mask_hidden); ctx.context_kv per layer."""
        if len(ctx.context_kv) != len(self.layers):
            raise ValueError(f"{self.kind!r} reads one context K/V per layer ({len(self.layers)}), "
                             f"got {len(ctx.context_kv)}")
        n, K = ctx.block_tokens.shape
        emb = self.embed_block(ctx.block_tokens)  # (N, K, H)
        first = ctx.last_hidden.flatten(1).to(emb.dtype)[:, None]  # (N, 1, n_sel*H)
        shared = self.mask_hidden.to(emb.dtype).expand(n, K - 1, -1)  # (N, K-1, n_sel*H)
        x, _ = self.run(emb, torch.cat([first, shared], dim=1), ctx.positions, ctx.context_kv, ctx.context_mask)
        return self.head(self.norm(x))  # (N, K, Vp)

    def context_kv_from_sequence(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
                                 ) -> list[KV]:
        """Drafter context K/V of a whole sequence from its start, e.g. for training.

        tokens (N, S) long; hidden (N, S, n_sel, H) the target's hidden states at those positions;
        positions (N, S), starting at 0. Entry t pairs x_t with h_{t-1} (the shared vector for t = 0).
        Returns per layer (k, v), each (N, S, Hkv, D), causal over the sequence (no window).
        """
        n, s = tokens.shape
        if hidden.shape[:2] != (n, s) or positions.shape != (n, s):
            raise ValueError(f"tokens (N, S), hidden (N, S, n_sel, H) and positions (N, S) must agree; got "
                             f"{tuple(tokens.shape)}, {tuple(hidden.shape)}, {tuple(positions.shape)}")
        emb = F.embedding(tokens, self.target_parts.embed_weight)  # (N, S, H)
        previous = hidden[:, :-1].flatten(-2).to(emb.dtype)  # (N, S-1, n_sel*H): h_0 .. h_{S-2}
        start = self.mask_hidden.to(emb.dtype).expand(n, 1, -1)  # no feature before position 0
        _, kvs = self.run(emb, torch.cat([start, previous], dim=1), positions, None, None)
        return kvs

    def context_kv_from_features(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                                 target_kv: dict[int, KV]) -> list[KV]:
        """Training runs the whole sequence's context entries, which need the tokens as well."""
        return self.context_kv_from_sequence(tokens, hidden, positions)

    # ---- Drafter interface -----------------------------------------------------------------------

    def commit(self, pool: PagedKVPool, seq_ids: Sequence[int], hidden: torch.Tensor | None,
               num_committed: torch.Tensor) -> None:
        """Queue the new positions' features (h_{t-1} for each new t); keep last_hidden (base class)."""
        previous = {s: self._last_hidden.get(s) for s in seq_ids}
        super().commit(pool, seq_ids, hidden, num_committed)
        assert hidden is not None  # the base class raised otherwise
        n_sel_h = self.mask_hidden.shape[0]
        for row, (seq_id, n, length) in enumerate(zip(seq_ids, num_committed.tolist(), pool.lengths(seq_ids))):
            start = length - n
            before = previous[seq_id]
            if start == 0:
                before = self.mask_hidden.detach().view(hidden.shape[2], -1)  # (n_sel, H)
            elif before is None:
                raise KeyError(f"sequence {seq_id}: positions from {start} committed before any earlier position")
            feats = torch.cat([before[None].to(hidden.dtype), hidden[row, : n - 1]]).reshape(n, n_sel_h)  # (n, n_sel*H)
            if seq_id in self._pending:  # several commits before a propose: must be consecutive
                first, queued = self._pending[seq_id]
                if first + queued.shape[0] != start:
                    raise ValueError(f"sequence {seq_id}: queued positions {first}..{first + queued.shape[0] - 1} "
                                     f"do not continue at {start}")
                start, feats = first, torch.cat([queued, feats])
            self._pending[seq_id] = (start, feats)

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        """Write the queued context entries' K/V into the pool, then draft (base class)."""
        self.extend_context(batch.pool, batch.seq_ids, batch.tokens)
        return super().propose(batch, K)

    def extend_context(self, pool: PagedKVPool, seq_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """Run the queued entries of every row through the drafter (causal, over the cached context
        before them) and store their K/V in the pool's drafter layers. tokens[b]: row b's history."""
        rows = [r for r, s in enumerate(seq_ids) if s in self._pending]
        if not rows:
            return
        ids = [seq_ids[r] for r in rows]
        queued = [self._pending.pop(s) for s in ids]
        starts = [start for start, _ in queued]
        counts = [feats.shape[0] for _, feats in queued]
        t = max(counts)
        device = queued[0][1].device
        feats = torch.zeros((len(rows), t, queued[0][1].shape[1]), dtype=queued[0][1].dtype, device=device)
        ids_t = torch.zeros((len(rows), t), dtype=torch.long, device=device)  # (B', T) right-padded
        for i, (r, (start, f)) in enumerate(zip(rows, queued)):
            feats[i, : f.shape[0]] = f
            ids_t[i, : f.shape[0]] = torch.tensor(list(tokens[r][start:start + f.shape[0]]), device=device)
        offsets = torch.arange(t, device=device)
        positions = torch.tensor(starts, device=device)[:, None] + offsets  # (B', T)
        valid = offsets[None, :] < torch.tensor(counts, device=device)[:, None]  # (B', T)
        context, context_mask = self.context_kv_from_pool(pool, ids, starts)  # positions < start
        emb = F.embedding(ids_t, self.target_parts.embed_weight)  # (B', T, H)
        # Right padding is safe: attention is causal, so no real entry sees a padded one.
        _, kvs = self.run(emb, feats, positions, context, context_mask)
        table = pool.slot_table(ids)
        slots = table.slots.gather(1, positions.clamp(max=table.slots.shape[1] - 1))  # (B', T)
        for layer, (k, v) in zip(self.context_pool_layers(pool), kvs):
            pool.write(layer, slots[valid][None], k[valid][None], v[valid][None])

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self._pending.pop(seq_id, None)
