"""H-Spec's greedy proposal for one sequence as one native call (`native_propose.cpp`), and the DFlash family's.

In Python a proposal of K = 7 drafts runs ~500 small ATen operators and ~40 products (the Mamba-2 scans,
norms, RoPE, attention over the target's K/V, the head and the Markov loop); on a 2-core CPU the interpreter
and dispatch between them cost several times what the products themselves do, so drafting cost more than a
target decode. `native_propose.cpp` computes the same math in the same order, the products through the
kernels the Python layers call (hspec's CPU kernels, through the dispatcher) and the small operators between
them as loops. Its attention, where hspec's kernels run, is one call of theirs (`hspec::block_attention`) that
reads the context K/V from the pool as the pool stores them (bf16 or fp32: views, not widened copies;
`block_context(..., as_stored=True)`) and sums in the target's attention's order, so its outputs differ from
the Python path's products in the last bits. Its drafts are the Python path's but where two logits lie within
such a rounding (tests/test_native_drafter.py checks drafts and logits against the Python path); the target
verifies every draft either way.

What `propose` hands it (`NeuralDrafter.native_drafts`): where the sequence's context window lies in consecutive
slots of the pool (a lone sequence's usually do), the pool itself (`propose_in_pool`): the call makes the block,
its RoPE (rows of a table made by `layers.rope_cos_sin`'s operators on the target's inverse frequencies) and the
context's views in C++, and returns the drafts as target ids, so Python makes no `BlockContext` (its ~10 tensor
operators cost tens of microseconds each right after a verify has pushed the interpreter's code and data out of
the caches: ~0.3 ms a proposal); elsewhere the `BlockContext` of `block_context` (`propose`), with the same bits.

What goes native: a proposal of one sequence whose rows are all greedy, on the CPU, without autograd
(`NativePropose.covers`), for a drafter whose modules it knows (`NativePropose.unfit_reason`): H-Spec's layers,
or the DFlash family's (DFlash, DSpark, DFlash-KVReuse: attention over their context, bidirectional in the
block, and MLP), with unfused q/k/v and gate/up, weights floating, int8, w8a8 or w4a8 (`models.formats`), a
Markov head or none. Sampled rows, batches and every other drafter (kinds that override the proposal, such as
DFlash2 or SpecBlock) keep the Python path. The two families share every line of it, so `hspec bench draft`
compares them like for like.

Built like the native decoder stack (`models.native._build`: torch's C++ extension loader, one build per
machine under hspec's build lock, a warning and the Python path where it cannot be built), bound once per
drafter by `runtime.prepare_for_inference` after its weights reached their final storage; HSPEC_NATIVE_DRAFTER=0
there keeps the Python path.

Legend: K block, S context keys, H hidden, Vp draft vocabulary, n_sel selected target layers.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from hspec.cache.paged_pool import PagedKVPool
from hspec.drafters.base import DraftBatch
from hspec.drafters.common import BlockContext, NativeDrafts
from hspec.drafters.dflash.layers import DraftLayer
from hspec.drafters.dflash.model import DFlashBackbone
from hspec.drafters.hspec.model import HSpecDrafter
from hspec.models.layers import Linear, RMSNorm
from hspec.models.native import _build, load_kernels

__all__ = ["NativePropose", "build_native_propose", "native_propose_for"]

_SOURCE = Path(__file__).with_name("native_propose.cpp")
# The drafter classes it runs (`NativePropose`), and the methods of theirs it computes: a subclass that
# overrides one proposes otherwise, in Python.
NATIVE_FAMILIES = (HSpecDrafter, DFlashBackbone)
_REPLACED = ("propose", "block_logits", "draft_greedy", "greedy_block", "slot_logits", "embed_block",
             "markov_logits", "block_hidden")
# native_propose.cpp's layer codes: which modules a drafter layer has.
_MAMBA, _ATTENTION = 1, 2
# native_propose.cpp's Markov head forms.
_NO_MARKOV, _MARKOV_MATRIX, _MARKOV_INT8 = 0, 1, 2


def build_native_propose() -> ModuleType | None:
    """Compile (or load the cached build of) `native_propose.cpp`; None, with a warning naming the cause,
    where that fails."""
    return _build("hspec_native_propose", _SOURCE, ["-O3"], "H-Spec's native proposal could not be built",
                  "the drafter proposes in Python instead, with the same drafts, slower")  # type: ignore[return-value]


def native_propose_for(drafter: nn.Module) -> NativePropose | None:
    """The native proposal of `drafter` where it fits (`NativePropose.unfit_reason`) and the extension builds,
    else None."""
    if not isinstance(drafter, NATIVE_FAMILIES) or NativePropose.unfit_reason(drafter) is not None:
        return None
    extension = build_native_propose()
    return None if extension is None else NativePropose(extension, drafter)


def _layer_modules(layer: nn.Module) -> tuple[nn.Module | None, ...]:
    """(mamba_norm, mamba, attn_norm, attn, mlp_norm, mlp) of an H-Spec layer or a DFlash-family `DraftLayer`
    (attention and MLP), None where the layer has no such module."""
    if isinstance(layer, DraftLayer):
        return None, None, layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp
    return layer.mamba_norm, layer.mamba, layer.attn_norm, layer.attn, layer.mlp_norm, layer.mlp


class NativePropose:
    """`native_propose.cpp` bound to one drafter of H-Spec's or the DFlash family's (DFlash, DSpark,
    DFlash-KVReuse: the same attention, MLP, head and Markov head, without Mamba-2 or S_init, attending to the
    whole block): `native(ctx, anchor_tokens)` is `drafter.draft_greedy` for a context it `covers`.

    It keeps references to the drafter's tensors as they are stored when it is built (quantized, the head's
    restricted rows made); weights replaced afterwards (a new draft vocabulary, a reload) are not seen, so
    build it after the last change (`runtime.prepare_for_inference` does).
    """

    def __init__(self, extension: ModuleType, drafter: HSpecDrafter | DFlashBackbone) -> None:
        reason = self.unfit_reason(drafter)
        if reason is not None:
            raise ValueError(f"the native proposal does not take this {drafter.kind!r} drafter: {reason}")
        c = drafter.config
        self.extension = extension
        hspec = isinstance(drafter, HSpecDrafter)
        # a block fits one SSD chunk (`covers`); without Mamba-2 any block the drafter takes
        self.chunk_size = c.mamba_config().chunk_size if hspec else c.max_draft_len  # type: ignore[union-attr]
        self.mask_token_id, self.vocab_size = c.mask_token_id, c.vocab_size
        injection = drafter.injection if hspec else None  # type: ignore[union-attr]
        self.injects = injection is not None
        self.eps = c.rms_norm_eps
        modules = [_layer_modules(layer) for layer in drafter.layers]
        mamba = next((m[1] for m in modules if m[1] is not None), None)
        self.mamba_eps = mamba.norm.eps if mamba is not None else 0.0
        # Mamba-2's (nh, P, N, G) where it has any (G = 1 and no heads where not), the attention's heads
        mamba_dims = [c.mamba_nheads, c.mamba_headdim, c.mamba_d_state, c.mamba_ngroups] if hspec else [0, 0, 0, 1]  # type: ignore[union-attr]
        self.dims = [*mamba_dims, c.num_heads, c.num_kv_heads, c.head_dim]
        attention = next((m[3] for m in modules if m[3] is not None), None)
        self.causal = attention is None or attention.causal  # causal in the block (H-Spec), or not (DFlash)
        # the attention through hspec's kernel where it runs here (reading the pool's K/V as stored), else ATen's
        # products over the K/V in the dtype the Python path multiplies them in
        self.reads_stored_kv = load_kernels()
        self.norm_kernel = all(m.kernel for m in drafter.modules() if isinstance(m, RMSNorm))
        self.layers = [_MAMBA * (m[1] is not None) + _ATTENTION * (m[3] is not None) for m in modules]
        self.rope = drafter.target_parts.rope  # the target's: (1, K) positions, dtype -> cos, sin (1, K, D)
        # its inverse frequencies (D/2,) where `rope` is layers.rope_cos_sin of them: the call then makes the RoPE
        # itself (`propose_in_pool`)
        self.inv_freq = drafter.target_parts.inv_freq
        # The flat list native_propose.cpp reads in this order, and per linear whether it is a `layers.Linear`.
        self.weights: list[torch.Tensor | None] = []
        self.row_invariant: list[bool] = []
        parts = drafter.target_parts
        self.weights += [parts.embed_weight, drafter.mask_embedding.detach()]
        if injection is not None:
            self._add_linear(injection.proj_r)
            self._add_linear(injection.proj_ds)
        for mamba_norm, m, attn_norm, attn, mlp_norm, mlp in modules:
            if m is not None and mamba_norm is not None:
                self.weights.append(mamba_norm.weight)
                self._add_linear(m.in_proj)
                # as Mamba2Mixer.forward turns them before use: taps (W, conv_dim) and D to the activations' dtype,
                # A and dt_bias to fp32
                dtype = drafter.mask_embedding.dtype
                bias = None if m.conv1d.bias is None else m.conv1d.bias.detach().to(dtype).contiguous()
                self.weights += [m.conv1d.weight.detach()[:, 0].t().to(dtype).contiguous(), bias,
                                 -torch.exp(m.A_log.detach().float()), m.dt_bias.detach().float().contiguous(),
                                 m.D.detach().to(dtype).contiguous(), m.norm.weight]
                self._add_linear(m.out_proj)
            if attn is not None and attn_norm is not None:
                qkv = attn.qkv
                self.weights.append(attn_norm.weight)
                for projection in (qkv.q_proj, qkv.k_proj, qkv.v_proj):
                    self._add_linear(projection)
                self.weights += [qkv.q_norm.weight, qkv.k_norm.weight]  # type: ignore[union-attr]
                self._add_linear(attn.o_proj)
            self.weights.append(mlp_norm.weight)  # type: ignore[union-attr]
            for projection in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):  # type: ignore[union-attr]
                self._add_linear(projection)
        self.weights.append(drafter.norm.weight)
        rows, scale, packed = drafter.head.inference_weights(drafter.mask_embedding.dtype)
        self.weights += [rows, None, scale, packed]
        self.row_invariant.append(True)  # the head multiplies through its weight format (`models.formats`)
        self.weights.append(drafter.head.draft_vocab_ids)
        self.markov = _NO_MARKOV
        markov = drafter.markov
        if markov is not None:
            self.weights.append(markov.W1.weight)
            int8 = markov.int8_weights(markov.W1.weight.dtype)  # rows W1 looks up have its dtype
            if int8 is not None:
                self.markov = _MARKOV_INT8
                rows, scale, packed = int8
                self.weights += [rows, None, scale, packed]
                self.row_invariant.append(True)
            else:
                self.markov = _MARKOV_MATRIX
                self.weights.append(markov.W2)
        self.weights = [None if w is None else w.detach() for w in self.weights]
        # the Markov head keeps the corrections it computed, by previous token (native_propose.cpp, `Corrections`;
        # its own int8 W2 only): the same drafts; False (then `_bind` again) to time the products every slot
        self.keep_corrections = True
        self.proposer = self._bind()

    def _bind(self):  # the extension's Proposer: the weights and sizes, converted to C++ once
        return self.extension.Proposer(self.weights, self.row_invariant, self.layers, self.mask_token_id,
                                       self.vocab_size, self.injects, self.markov, self.dims, self.eps,
                                       self.mamba_eps, self.norm_kernel, self.causal, self.reads_stored_kv,
                                       self.inv_freq, self.keep_corrections)

    def __deepcopy__(self, memo: dict) -> NativePropose:
        """A deep copy of its drafter binds the copy's tensors (`memo`); the compiled extension is shared."""
        copied = copy.copy(self)
        copied.weights = copy.deepcopy(self.weights, memo)
        copied.rope = copy.deepcopy(self.rope, memo)
        copied.inv_freq = copy.deepcopy(self.inv_freq, memo)
        copied.proposer = copied._bind()
        return copied

    def _add_linear(self, module: nn.Linear) -> None:
        """weight, bias, scale, packed of a `layers.Linear` (scale and packed None for a plain nn.Linear)."""
        self.weights += [module.weight, module.bias, getattr(module, "weight_scale", None),
                         getattr(module, "weight_packed", None)]
        self.row_invariant.append(isinstance(module, Linear))

    @staticmethod
    def unfit_reason(drafter: HSpecDrafter | DFlashBackbone) -> str | None:
        """Why the native proposal cannot run `drafter`'s modules, or None where it can."""
        c = drafter.config
        family = HSpecDrafter if isinstance(drafter, HSpecDrafter) else DFlashBackbone
        overridden = [name for name in _REPLACED
                      if getattr(type(drafter), name, None) is not getattr(family, name, None)]
        if overridden:  # DFlash2, DFly, DeLS, SpecBlock: their own proposal on DFlash's backbone
            return f"it overrides {', '.join(overridden)}, which the native call computes as {family.__name__}'s"
        if drafter.mask_embedding.device.type != "cpu":
            return f"it runs on the CPU only, the drafter is on {drafter.mask_embedding.device}"
        if drafter.mask_embedding.dtype not in (torch.float32, torch.bfloat16):
            return f"it runs float32 or bfloat16 drafters, not {drafter.mask_embedding.dtype}"
        if drafter._target is None:
            return "no target attached"
        if isinstance(drafter, HSpecDrafter) and c.num_attention and not c.attend_target:  # type: ignore[union-attr]
            return "its attention reads the target's K/V (attend_target)"
        norms = {m.kernel for m in drafter.modules() if isinstance(m, RMSNorm)}
        if len(norms) > 1:
            return "its norms run one kernel throughout"
        modules = [_layer_modules(layer) for layer in drafter.layers]
        if len({m[3].causal for m in modules if m[3] is not None}) > 1:
            return "its attention modules are all causal in the block or none is"
        for _, mixer, _, attn, _, mlp in modules:
            mamba = mixer.config if mixer is not None else None
            if mamba is not None and (mamba.use_kernel or mamba.chunk_size < c.max_draft_len):
                return "its Mamba-2 scans run in PyTorch over one chunk"
            if attn is not None:
                qkv = attn.qkv
                if qkv.qkv_weight is not None or qkv.q_norm is None or qkv.k_norm is None:
                    return "its attention has unfused q/k/v with per-head q/k norms"
            if mlp.gate_up_weight is not None:
                return "its MLP has unfused gate and up"
        return None

    def covers(self, ctx: BlockContext) -> bool:
        """One sequence on the CPU, no autograd, no token history, a block within one SSD chunk."""
        return ctx.history is None and self._covers(ctx.block_tokens.shape[0], ctx.block_tokens.device, ctx.K)

    def covers_batch(self, batch: DraftBatch, K: int) -> bool:
        """`covers` for the context `block_context(batch, K)` makes (which has no token history)."""
        return self._covers(len(batch.seq_ids), batch.anchor_tokens.device, K)

    def _covers(self, rows: int, device: torch.device, K: int) -> bool:
        return rows == 1 and device.type == "cpu" and not torch.is_grad_enabled() and K <= self.chunk_size

    @property
    def reads_in_place(self) -> bool:
        """Whether `propose_in_pool` runs here: hspec's attention kernel and the target's RoPE frequencies."""
        return self.reads_stored_kv and self.inv_freq is not None

    def __call__(self, ctx: BlockContext, anchor_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts (1, K) as draft-vocabulary indices and their confidence (1, K), as `draft_greedy` returns them."""
        out = self.propose(ctx, anchor_tokens)
        return out.local, out.confidence

    def forward(self, ctx: BlockContext, anchor_tokens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The drafts (1, K) as draft-vocabulary indices, their confidence (1, K) fp32 and the backbone logits U
        (1, K, Vp)."""
        out = self.propose(ctx, anchor_tokens)
        return out.local, out.confidence, out.logits

    def propose(self, ctx: BlockContext, anchor_tokens: torch.Tensor, timed: bool = False) -> NativeDrafts:
        """The proposal of a block and context made in Python (`NeuralDrafter.block_context`, which `covers`
        takes); `timed`: also time it by section (`NativeDrafts.timings`)."""
        dtype = self.weights[1].dtype  # type: ignore[union-attr]  # the mask embedding's: the drafter's
        cos, sin = self.rope(ctx.positions, dtype)  # (1, K, D) each, the target's RoPE
        context = [t for pair in ctx.context_kv for t in pair]
        return NativeDrafts(*self.proposer.propose(ctx.block_tokens, cos, sin, ctx.last_hidden, context,
                                                   ctx.context_mask, anchor_tokens, timed))

    def propose_in_pool(self, anchor_tokens: torch.Tensor, K: int, last_hidden: torch.Tensor, pool: PagedKVPool,
                        seq_id: int, layers: list[int], window: int, timed: bool = False) -> NativeDrafts | None:
        """The proposal of sequence `seq_id` (`reads_in_place` must hold) with its context read from `pool` in place:
        the same drafts, confidences and logits as `propose` of its `block_context`, without making that in Python
        (the block, its RoPE and the context's views are made in the call). None where the context's slots are
        not consecutive (`PagedKVPool.consecutive_window`): `propose` then takes the copies `block_context` makes.

        anchor_tokens (1,) long x0; last_hidden (n_sel, H) the selected target layers' hidden states at position
        p - 1; layers: the pool layer each attention module reads (`context_pool_layers`); window: the drafter's
        sliding window (its context is the last min(p, window) positions).
        """
        found = pool.consecutive_window(seq_id, window)
        if found is None:
            return None
        start, keys = found
        return NativeDrafts(*self.proposer.propose_in_pool(anchor_tokens, pool.length(seq_id), K, last_hidden, pool.k,
                                                           pool.v, layers, start, keys, timed))

    def section_times(self, timings: torch.Tensor) -> tuple[dict[str, tuple[float, float]], tuple[float, float]]:
        """A timed proposal's `NativeDrafts.timings` as ({section: (this thread's CPU time, wall time)}, the whole
        call's (CPU, wall)), in milliseconds, each section summed over the drafter's layers."""
        rows = [(cpu / 1e6, wall / 1e6) for cpu, wall in timings.tolist()]
        return dict(zip(self.extension.section_names(), rows[:-1], strict=True)), rows[-1]
