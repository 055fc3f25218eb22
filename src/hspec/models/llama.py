"""The Llama-family target decoder, running over the paged KV pool.

Parameter names follow the Hugging Face checkpoints (see `loading.hf_to_runtime_key` for the two
renames). The model never samples: it returns logits and, on request, the hidden
states of chosen layers, which the drafters use as context.

Hidden-state layer indices follow HF's `hidden_states` tuple: 0 is the embedding output and l
(1..L) is the output of decoder layer l, before the final norm.

Legend: B batch, T new tokens, S context length, H hidden, V vocab, Hq/Hkv heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hspec.cache.paged_pool import PagedKVPool, SlotTable
from hspec.models.config import TargetConfig, rope_inverse_frequencies
from hspec.models.dtype import dtype_name
from hspec.models.layers import (
    Linear,
    QKVProjection,
    RMSNorm,
    SwiGLU,
    attend,
    attend_prefill,
    key_multiple,
    rope_cos_sin,
    row_invariant,
)
from hspec.models.native import NativeDecoderStack


@dataclass(frozen=True)
class TargetOutput:
    """logits: (B, T, V), or (B, 1, V) when only the last position was asked for.
    hidden: (B, T, len(hidden_layers), H) hidden states of the requested layers, or None.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None


@dataclass(frozen=True)
class ForwardPass:
    """What every decoder layer of one forward shares."""

    cos: torch.Tensor  # (B, T, 1, D) RoPE tables of the new tokens' positions (`rope_cos_sin`)
    sin: torch.Tensor  # (B, T, 1, D)
    pool: PagedKVPool
    write_slots: torch.Tensor  # (B, T) pool slots the new tokens' K/V go to
    table: SlotTable  # the keys' slots: a row per sequence (B, S), or per tree node (B T, S') (`_tree_table`)
    mask: torch.Tensor | None  # (rows, 1, T', S) bool, True = may attend


class Attention(nn.Module):
    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        c = config
        self.qkv = QKVProjection(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                 c.attention_bias, c.qk_norm, c.rms_norm_eps)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.kernel = False  # decodes and verifies attend with hspec's kernel (`layers.attend`; build_model sets it)

    def forward(self, x: torch.Tensor, fwd: ForwardPass, layer_index: int) -> torch.Tensor:
        """x (B, T, H) -> (B, T, H) for a decode or a verify. `fwd.table` has a row per sequence (B), or a row
        per new token (B T) for a tree, each token then attending as a sequence of its own (`_tree_table`)."""
        b, t = x.shape[:2]
        q, k, v = self.qkv(x, fwd.cos, fwd.sin)  # (B, T, Hq, D), (B, T, Hkv, D) x2
        keys, values = self._write_and_read(k, v, fwd, layer_index, key_multiple(x))
        rows, s = fwd.table.slots.shape
        out = attend(q.reshape(rows, b * t // rows, *q.shape[2:]), keys, values, fwd.mask, s,
                     self.kernel)  # (rows, T', Hq D)
        return self.o_proj(out.reshape(b, t, -1))

    def prefill(self, x: torch.Tensor, fwd: ForwardPass, layer_index: int) -> torch.Tensor:
        """`forward` for a prompt's tokens (one row per sequence): products in one call, other bits
        (`TargetModel.prefill`)."""
        b, t = x.shape[:2]
        q, k, v = self.qkv.prefill(x, fwd.cos, fwd.sin)  # (B, T, Hq, D), (B, T, Hkv, D) x2
        keys, values = self._write_and_read(k, v, fwd, layer_index, key_multiple(x))
        out = attend_prefill(q, keys, values, fwd.mask, fwd.table.slots.shape[1], self.kernel)  # (B, T, Hq D)
        return self.o_proj.prefill(out)

    @staticmethod
    def _write_and_read(k: torch.Tensor, v: torch.Tensor, fwd: ForwardPass, layer_index: int, multiple: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' K/V first, so that they see themselves, then read the keys of `fwd.table`:
        each (rows, S' >= S, Hkv, D)."""
        fwd.pool.write(layer_index, fwd.write_slots, k, v)
        return fwd.pool.gather(layer_index, fwd.table, multiple)


class DecoderLayer(nn.Module):
    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, fwd: ForwardPass, layer_index: int) -> torch.Tensor:
        """x (B, T, H) -> (B, T, H) for a decode or a verify."""
        x = x + self.self_attn(self.input_layernorm(x), fwd, layer_index)  # (B, T, H)
        return x + self.mlp(self.post_attention_layernorm(x))

    def prefill(self, x: torch.Tensor, fwd: ForwardPass, layer_index: int) -> torch.Tensor:
        """`forward` for a prompt's tokens (`Attention.prefill`)."""
        x = x + self.self_attn.prefill(self.input_layernorm(x), fwd, layer_index)  # (B, T, H)
        return x + self.mlp.prefill(self.post_attention_layernorm(x))


class TargetModel(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 / SmolLM2 decoder whose KV cache is a `PagedKVPool`.

    native: the decoder layers in C++ (`models.native`) for the forwards it covers (decodes and verifies
    in a row-invariant dtype), with the Python layers' bits; None runs the Python layers always.
    `loading.build_model` sets it once the weights are in their final storage.
    """

    native: NativeDecoderStack | None

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        self.native = None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)

    def new_pool(self, num_pages: int, page_size: int = 16, num_drafter_layers: int = 0) -> PagedKVPool:
        """A KV pool shaped for this model, on its device, in `kv_dtype` (torch products over it in
        `kv_product_dtype`), K transposed for the row-invariant attention (`PagedKVPool`)."""
        c = self.config
        return PagedKVPool(c.num_layers, c.num_kv_heads, c.head_dim, num_pages, page_size, num_drafter_layers,
                           dtype=self.kv_dtype, device=self.embed_tokens.weight.device,
                           transposed_k=self.row_invariant_attention, product_dtype=self.kv_product_dtype)

    @property
    def row_invariant_attention(self) -> bool:
        """Whether this model's attention takes the row-invariant kernels (bf16, int8 and int4 on the CPU;
        models/layers.py) rather than the fused one."""
        return row_invariant(self.embed_tokens.weight)

    @property
    def tree_shares_keys(self) -> bool:
        """Whether a drafted tree's rows read their sequence's keys as they lie in the pool, other branches'
        among their own, under a tree mask (`_tree_mask`), rather than each its own gathered copy of its
        prefix and ancestors (`_tree_table`): where every layer attends with hspec's kernel over the float32
        pool, which sums a row's visible keys alone, in key order, whatever sits between them
        (`layers.attend`). At 1,536 keys a 17-token tree's forward then reads the prefix once, not 17 times."""
        return self.attention_kernel

    @property
    def attention_kernel(self) -> bool:
        """Whether every layer's decodes and verifies attend with hspec's kernel (`layers.attend`)."""
        return all(layer.self_attn.kernel for layer in self.layers)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of this model's KV pool. Where the attention is row-invariant, its keys and values are bf16
        numbers (the bf16 layers compute them), which a float32 or bfloat16 pool holds exactly: bfloat16 where
        hspec's kernel attends (it widens each key and value to fp32 as it reads it: the bits of a float32
        pool, half the bytes; a decode at 2,048 SmolLM2 keys reads 47 MB of K/V instead of 94), float32 where
        torch's products do (`layers._attend_row_invariant`: MKL's fp32 product ~8 us for a decode's 3 x 64 x
        S shapes, oneDNN's bf16 one ~35; docs/fast-path.md); the weights' dtype elsewhere."""
        weights = self.embed_tokens.weight.dtype
        if not self.row_invariant_attention:
            return weights
        return torch.bfloat16 if self.attention_kernel and weights == torch.bfloat16 else torch.float32

    @property
    def kv_product_dtype(self) -> torch.dtype:
        """The dtype torch products over this model's pool take its K/V in (a drafter's context products, a
        prompt's attention): float32 for a row-invariant target, whatever the pool holds, so a bfloat16 pool
        changes no number (`PagedKVPool`'s product_dtype); `kv_dtype` elsewhere."""
        return torch.float32 if self.row_invariant_attention else self.kv_dtype

    @property
    def dtype_name(self) -> str:
        """The `--dtype` this model runs in: 'w4a8', 'int4' or 'int8' once `models.formats.store` stored its
        linears that way (an int4 or w4a8 model keeps an int8 LM head), else its weights' floating dtype
        ('float32', 'bfloat16')."""
        layer_formats = {getattr(module, name).name for module in self.layers.modules()
                         for name in ("weight_format", "qkv_format", "gate_up_format") if hasattr(module, name)}
        for quantized in ("w4a8", "int4"):
            if quantized in layer_formats:
                return quantized
        if self.lm_head.weight_format.name in ("int8", "w8a8"):
            return "int8"
        return dtype_name(self.embed_tokens.weight.dtype)

    def lm_head_weight(self) -> torch.Tensor:
        """The LM head as a floating (V, H) matrix, for drafters that share it: the embedding when they
        are tied, the int8 rows times their scales when a quantized dtype stored it so."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        head = self.lm_head
        dtype = head.weight.dtype if head.weight_scale is None else head.weight_scale.dtype  # the compute dtype
        return head.weight_format.floating_weight(head.weight, head.weight_scale, dtype)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, T, D) for `positions` (B, T); drafters reuse this to continue the prefix's RoPE."""
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def forward(self, input_ids: torch.Tensor, pool: PagedKVPool, seq_ids: Sequence[int],
                hidden_layers: Sequence[int] = (), last_logits_only: bool = False,
                tree_mask: torch.Tensor | None = None) -> TargetOutput:
        """A decode or a verify: run `input_ids` (B, T) as the next T tokens of each sequence in `pool`,
        every row with the bits it gets alone (a token's logits are the same in a 1-token decode and as a
        row of a verify; see models/layers.py).

        The new tokens' K/V are appended to the pool (the caller rolls back what it rejects with
        `pool.truncate`). Every sequence in the batch gets T new tokens; their context lengths may
        differ (ragged), which the attention mask handles.

        tree_mask: (B, T, T) bool, or None for a chain. Given, the T new tokens form a drafted tree
        rooted at token 0 (decoding/tree_verify.py): new token i sees the prefix and the new tokens j
        with tree_mask[b, i, j] (itself and its ancestors), at position start + depth(i), depth(i) =
        the ancestors it sees. Their K/V fill the next T slots in order, so a node's ancestors lie among
        other branches' keys; a tree row still sums its keys as the decode of its path does, and keeps
        that row's bits in bf16, int8, int4 and w4a8 (docs/fast-path.md): hspec's attention kernel skips
        the keys a row may not see (`tree_shares_keys`: all rows read the sequence's keys under a tree
        mask, `_tree_mask`); elsewhere each token attends as a sequence of its own whose keys are its
        prefix and ancestors in position order (`_tree_table`).
        """
        return self._run(input_ids, pool, seq_ids, hidden_layers, last_logits_only, tree_mask, prefill=False)

    def prefill(self, input_ids: torch.Tensor, pool: PagedKVPool, seq_ids: Sequence[int],
                hidden_layers: Sequence[int] = (), last_logits_only: bool = False) -> TargetOutput:
        """A prompt's prefill: `forward` for T tokens that are a prompt's, never a verify or a decode.

        Its decoder layers' products need not keep a decode's bits, so they run in one floating call each
        (`WeightFormat.prefill`): an int8 target multiplies its weights dequantized for the call, an int4 or
        w4a8 one its levels' floating values, for int8 0.6x the kernel's time for a 512-token prompt here,
        logits within int8 rounding of the kernel's but not its bits. Plain and speculative decoding share
        the prompt's prefill, so their outputs stay equal; every later token goes through `forward`.
        """
        return self._run(input_ids, pool, seq_ids, hidden_layers, last_logits_only, None, prefill=True)

    def _run(self, input_ids: torch.Tensor, pool: PagedKVPool, seq_ids: Sequence[int], hidden_layers: Sequence[int],
             last_logits_only: bool, tree_mask: torch.Tensor | None, prefill: bool) -> TargetOutput:
        """`forward` (prefill False) or `prefill` (True)."""
        b, t = input_ids.shape
        if len(seq_ids) != b:
            raise ValueError(f"{len(seq_ids)} sequence ids for a batch of {b}")
        for layer in hidden_layers:
            if not 0 <= layer <= self.config.num_layers:
                raise ValueError(f"hidden layer {layer} outside 0..{self.config.num_layers}")
        starts = torch.tensor(pool.lengths(seq_ids), dtype=torch.long, device=input_ids.device)
        if int(starts.max()) + t > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {int(starts.max()) + t} exceeds the target's context of "
                f"{self.config.max_position_embeddings} tokens"
            )
        write_slots = pool.extend(seq_ids, t)  # (B, T)
        table = pool.slot_table(seq_ids)  # (B, S)
        node_tables = tree_mask is not None and not self.tree_shares_keys
        if tree_mask is None:
            positions = starts[:, None] + torch.arange(t, device=input_ids.device)  # (B, T)
            mask = _causal_mask(positions, table)
        else:
            if tree_mask.shape != (b, t, t):
                raise ValueError(f"tree_mask must be {(b, t, t)}, got {tuple(tree_mask.shape)}")
            positions = starts[:, None] + tree_mask.sum(-1) - 1  # (B, T) start + depth
            if node_tables:
                table, mask = _tree_table(starts, tree_mask, table)
            else:
                mask = _tree_mask(starts, tree_mask, table)
        x = self.embed_tokens(input_ids)  # (B, T, H)
        cos, sin = (angles[:, :, None] for angles in self.rope(positions, x.dtype))  # (B, T, 1, D), all layers
        wanted = set(hidden_layers)
        collected = {0: x} if 0 in wanted else {}
        if not prefill and self.native is not None and self.native.covers(x, node_tables):
            layers = sorted(wanted - {0})
            x, outputs = self.native(x, cos, sin, pool.k, pool.v, pool.capacity_tokens, write_slots, table.slots,
                                     table.contiguous_start, mask, layers)
            collected.update(zip(layers, outputs))
        else:
            fwd = ForwardPass(cos, sin, pool, write_slots, table, mask)
            for i, layer in enumerate(self.layers):
                x = layer.prefill(x, fwd, i) if prefill else layer(x, fwd, i)
                if i + 1 in wanted:
                    collected[i + 1] = x
        if last_logits_only:
            x = x[:, -1:]
        logits = self.lm_head(self.norm(x))
        hidden = torch.stack([collected[i] for i in hidden_layers], dim=2) if hidden_layers else None
        return TargetOutput(logits, hidden)


def _tree_mask(starts: torch.Tensor, tree_mask: torch.Tensor, table: SlotTable) -> torch.Tensor:
    """(B, 1, T, S): new token i of sequence b sees the keys of positions 0..start-1 and of the new tokens j
    with tree_mask[b, i, j] (slots start + j), nothing after its sequence's start + T keys."""
    b, t, _ = tree_mask.shape
    key = torch.arange(table.slots.shape[1], device=starts.device)
    relative = key[None, :] - starts[:, None]  # (B, S) index among the new tokens, < 0 in the prefix
    among_new = tree_mask.gather(2, relative.clamp(0, t - 1)[:, None, :].expand(b, t, -1))  # (B, T, S)
    visible = torch.where(relative[:, None, :] < 0, True, among_new & (relative < t)[:, None, :])
    return visible[:, None]


def _tree_table(starts: torch.Tensor, tree_mask: torch.Tensor, table: SlotTable
                ) -> tuple[SlotTable, torch.Tensor]:
    """A slot table with one row per new token of a tree, (B T, S'), and its mask (B T, 1, 1, S').

    Row (b, i) lists the slots of positions 0..start-1 of sequence b, then of the new tokens j with
    tree_mask[b, i, j] in index order (x0, then i's ancestors by depth, then i): the keys the decode
    of the path to i reads, in its order. Interleaving the tree's other branches among them instead
    would change the grouping of the softmax and value sums, and a bf16 or int8 row's bits with it.
    The rows end at start + depth(i) + 1 keys; the masked keys after that weigh exactly 0, as a
    verify row's extra keys do.
    """
    b, t, _ = tree_mask.shape
    device = starts.device
    index = torch.arange(t, device=device)
    seen = tree_mask.sum(-1)  # (B, T) depth + 1
    # each row's visible new tokens first, in index order: sort keys index (seen) or t + index (not)
    order = torch.where(tree_mask, index, t + index).sort(-1).values  # (B, T, T)
    width = int((starts[:, None] + seen).max())
    key = torch.arange(width, device=device)  # (S',)
    relative = key[None, None, :] - starts[:, None, None]  # (B, 1, S') index among the new tokens
    new = starts[:, None, None] + order.gather(2, relative.clamp(0, t - 1).expand(b, t, width))  # (B, T, S')
    positions = torch.where(relative < 0, key[None, None, :], new)  # (B, T, S')
    lengths = (starts[:, None] + seen).reshape(-1)  # (B T,)
    visible = key[None, :] < lengths[:, None]  # (B T, S')
    positions = torch.where(visible.view(b, t, width), positions, 0)
    slots = table.slots.gather(1, positions.view(b, t * width)).view(b * t, width)
    return SlotTable(slots, lengths, None), visible[:, None, None]


def _causal_mask(positions: torch.Tensor, table: SlotTable) -> torch.Tensor | None:
    """(B, 1, T, S): key s is visible to the query at position p iff s <= p and s is valid.

    Returns None when a single sequence's queries see the whole context (a 1-token decode), so
    attention can skip masking.
    """
    b, t = positions.shape
    s = table.slots.shape[1]
    if b == 1 and t == 1:
        return None
    key_pos = torch.arange(s, device=positions.device)
    visible = key_pos[None, None, :] <= positions[:, :, None]  # (B, T, S)
    visible &= key_pos[None, None, :] < table.lengths[:, None, None]
    return visible[:, None]
