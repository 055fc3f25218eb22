"""H-Spec as a vLLM proposer (pinned vLLM 0.32, CPU build): `speculative_config={"method": "custom_class",
"model": "hspec.integrations.vllm.proposer.HSpecProposer", "num_speculative_tokens": K}`.

What vLLM gives it, through hspec's plugin (`plugin.register` patches the model runner for this class
only; vLLM's own custom-class call passes token ids alone):
- the target's hidden states of the drafter's 5 tapped layers (`target_layers`, HF indices: the input
  of decoder layer l) for every row of the step's forward, from vLLM's aux-hidden-state outputs;
- the step's attention metadata: per request the query rows, the KV length and the block table, with
  which the drafter's attention reads the target's paged KV cache of the last 3 tapped layers in place.

What it runs: hspec's own H-Spec modules (`HSpecDrafter.draft_greedy`: the block forward, then the greedy loop,
Markov head included) on a `BlockContext` built from vLLM's tensors; only the context K/V read is
new here (`paged_context_kv`). The block's own K/V stay the transient tensors of `BlockAttention`.
It owns no attention layer, so vLLM allocates no drafter KV blocks: its KV capacity equals plain's.

Which checkpoint (an hspec H-Spec drafter directory, `hspec train --drafter hspec`):
1. `hf_overrides={"hspec_drafter": PATH}` on the `vllm.LLM` (per engine; vLLM copies it into the
   target's HF config, which custom-class proposers share);
2. else the environment variable `HSPEC_VLLM_DRAFTER` (read in the worker process);
3. else the drafter shipped for the target folder's name (`hspec.runtime.shipped_drafter_path`),
   e.g. `src/hspec/assets/hspec-smollm2-135m-instruct/` for SmolLM2-135M-Instruct.

Drafts are greedy (argmax), like vLLM's n-gram and custom proposers: vLLM verifies them without draft
probabilities, which keeps sampling exact at any temperature.

How many drafts a request gets (`DraftLength`, docs/vllm.md#draft-length-under-load): K by default; with
`hf_overrides={"hspec_draft_budget": B}` at most B drafts per step over the whole batch (K per request
while N K <= B, then B // N, and a step with B < N drafts nothing), so a loaded batch verifies fewer rows;
with `{"hspec_confidence_floor": P}` each request keeps only its leading drafts H-Spec gives at least
P (at least one), as `hspec:P` does in hspec's engine; with `{"hspec_draft_length": "auto"}` each request
gets the length that pays most per step cost, as `hspec:auto` does in hspec's engine, from costs timed on
the engine's own steps once per machine (`adaptive.AdaptiveLength`; `{"hspec_step_cost": "D,T,TS,F"}`
gives them). None looks at the target's verdict, so the output stays the target's.

Legend: B requests in the step, N requests drafted, T rows of the step's forward, K drafts, S context
keys, H hidden, Hkv KV heads, D head dim, nb KV blocks, bs block size, n_sel tapped layers.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hspec.decoding.step_cost import machine_key
from hspec.drafters import DRAFTERS
from hspec.drafters.checkpoint import load_drafter, read_checkpoint
from hspec.drafters.common import BlockContext, NeuralDrafter, build_block
from hspec.drafters.cost_aware import ADAPTIVE_LENGTH
from hspec.drafters.early_stop import leading_confident
from hspec.drafters.hspec.model import HSpecDrafter
from hspec.drafters.step_cost import StepCost
from hspec.integrations.vllm.adaptive import AdaptiveLength
from hspec.models.config import TargetConfig, rope_inverse_frequencies
from hspec.models.dtype import dtype_name
from hspec.models.layers import rope_cos_sin
from hspec.models.loading import cache_root, read_config
from hspec.runtime import prepare_for_inference

PROPOSER_CLASS = "hspec.integrations.vllm.proposer.HSpecProposer"
HF_OVERRIDE_KEY = "hspec_drafter"  # hf_overrides={"hspec_drafter": PATH}
HF_BUDGET_KEY = "hspec_draft_budget"  # hf_overrides={"hspec_draft_budget": B}: drafts per step, whole batch
HF_FLOOR_KEY = "hspec_confidence_floor"  # hf_overrides={"hspec_confidence_floor": P}: H-Spec's `:P` cut
HF_LENGTH_KEY = "hspec_draft_length"  # hf_overrides={"hspec_draft_length": "auto"}: H-Spec's `:auto` length
HF_COST_KEY = "hspec_step_cost"  # hf_overrides={"hspec_step_cost": "D,T,TS,F"}: `:auto`'s costs, given
ENV_DRAFTER = "HSPEC_VLLM_DRAFTER"
# vLLM CPU attention ISAs whose paged layout `paged_context_kv` reads (the others pack keys differently).
READABLE_ISAS = ("vec",)
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.attn$")


def hspec_config(K: int | None, drafter_path: str | Path | None = None, draft_budget: int | None = None,
                 confidence_floor: float | None = None, adaptive: bool = False,
                 step_cost: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(speculative_config, hf_overrides) for a `vllm.LLM` drafting K tokens with H-Spec from `drafter_path`
    (None: the drafter shipped for the target). K None leaves `num_speculative_tokens` for the caller to set.
    `draft_budget`, `confidence_floor`, `adaptive` (with `step_cost`, "D,T,TS[,F]" or None: timed): the
    `DraftLength` settings (None / False: off)."""
    config: dict[str, Any] = {"method": "custom_class", "model": PROPOSER_CLASS}
    if K is not None:
        config["num_speculative_tokens"] = K
    overrides: dict[str, Any] = {}
    if drafter_path is not None:
        overrides[HF_OVERRIDE_KEY] = str(drafter_path)
    if draft_budget is not None:
        overrides[HF_BUDGET_KEY] = draft_budget
    if confidence_floor is not None:
        overrides[HF_FLOOR_KEY] = confidence_floor
    if adaptive:
        overrides[HF_LENGTH_KEY] = ADAPTIVE_LENGTH
        if step_cost is not None:
            overrides[HF_COST_KEY] = step_cost
    return config, overrides


@dataclass(frozen=True)
class DraftLength:
    """How many drafts each request of a step gets (module docstring): K, a per-step budget over the
    batch, a confidence floor, or the cost-aware length. budget None = no budget; confidence_floor None = no
    cut; adaptive: `:auto` (`adaptive.AdaptiveLength`), with step_cost given or (None) timed."""

    K: int
    budget: int | None = None
    confidence_floor: float | None = None
    adaptive: bool = False
    step_cost: StepCost | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget < 0:
            raise ValueError(f"{HF_BUDGET_KEY} must be >= 0 (drafts per step over the batch), got {self.budget}")
        if self.confidence_floor is not None and not 0.0 <= self.confidence_floor < 1.0:
            raise ValueError(f"{HF_FLOOR_KEY} must be in [0, 1), got {self.confidence_floor}")
        if self.adaptive and (self.budget is not None or self.confidence_floor is not None):
            raise ValueError(f"{HF_LENGTH_KEY}={ADAPTIVE_LENGTH!r} chooses each request's length itself; it takes "
                             f"no {HF_BUDGET_KEY} or {HF_FLOOR_KEY}")
        if self.step_cost is not None and not self.adaptive:
            raise ValueError(f"{HF_COST_KEY} is read by {HF_LENGTH_KEY}={ADAPTIVE_LENGTH!r} only")

    @classmethod
    def of(cls, vllm_config: Any) -> DraftLength:
        """K from the speculative config, budget, floor and the adaptive length from the target's hf_overrides."""
        hf_config = vllm_config.model_config.hf_config
        budget, floor = getattr(hf_config, HF_BUDGET_KEY, None), getattr(hf_config, HF_FLOOR_KEY, None)
        length, cost = getattr(hf_config, HF_LENGTH_KEY, None), getattr(hf_config, HF_COST_KEY, None)
        if length not in (None, ADAPTIVE_LENGTH):
            raise ValueError(f"{HF_LENGTH_KEY} must be {ADAPTIVE_LENGTH!r} (or absent), got {length!r}")
        return cls(int(vllm_config.speculative_config.num_speculative_tokens),
                   None if budget is None else int(budget), None if floor is None else float(floor),
                   length == ADAPTIVE_LENGTH, None if cost is None else StepCost.parse(str(cost)))

    def per_request(self, num_requests: int) -> int:
        """Drafts per request in a step drafting for `num_requests` requests: K, or budget // N if fewer."""
        if self.budget is None:
            return self.K
        return min(self.K, self.budget // max(num_requests, 1))

    def trim(self, drafts: list[list[int]], confidence: torch.Tensor) -> list[list[int]]:
        """Each row's drafts up to the first one of confidence below the floor (at least one).

        drafts: N rows of K ids; confidence: (N, K) the drafter's probability of each draft."""
        if self.confidence_floor is None:
            return drafts
        sure = leading_confident(confidence, self.confidence_floor)  # (N,), the cut of `hspec:P`
        return [row[:n] for row, n in zip(drafts, sure.tolist())]


def step_cost_path(vllm_config: Any, checkpoint: Path, K: int) -> Path:
    """Where `:auto`'s costs for this machine, vLLM version, target, dtype, checkpoint and K are cached."""
    import vllm

    model_config = vllm_config.model_config
    key = machine_key("vllm", vllm.__version__, model_config.model, model_config.dtype, checkpoint.resolve(), K)
    return cache_root() / "vllm_step_costs" / f"{key}.json"


def drafter_path(vllm_config: Any) -> Path:
    """The H-Spec checkpoint this engine drafts with: hf_overrides, then $HSPEC_VLLM_DRAFTER, then the shipped one."""
    from hspec.runtime import shipped_drafter_path

    model_config = vllm_config.model_config
    chosen = getattr(model_config.hf_config, HF_OVERRIDE_KEY, None) or os.environ.get(ENV_DRAFTER)
    if chosen:
        return Path(chosen)
    return shipped_drafter_path("hspec", Path(model_config.model).name)


@dataclass(frozen=True)
class _Rows:
    """A (V, H) weight under the attribute name hspec's drafters read (`embed_tokens.weight`)."""

    weight: torch.Tensor


class VllmTargetView:
    """What hspec's trained drafters read from their target (`NeuralDrafter.attach_target`), over vLLM's model.

    config: hspec's `TargetConfig` of the target's HF folder. The embedding and LM head are vLLM's own
    tensors (rows past V, vLLM's vocabulary padding, cut off), shared, not copied. RoPE: hspec's tables
    for the same (theta, scaling), so drafted positions continue the keys vLLM cached.
    """

    def __init__(self, config: TargetConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        v = config.vocab_size
        self.config = config
        self.embed_tokens = _Rows(embed_weight[:v])  # (V, H)
        self._lm_head = lm_head_weight[:v]  # (V, H)
        self.inv_freq = rope_inverse_frequencies(config).to(embed_weight.device)  # (D/2,)

    @classmethod
    def of(cls, model: Any, model_dir: str | Path) -> VllmTargetView:
        """The view of a loaded vLLM causal LM (`model.model.embed_tokens`, `model.lm_head`)."""
        config = read_config(Path(model_dir))
        embed = model.model.embed_tokens.weight
        lm_head = embed if config.tie_word_embeddings else model.lm_head.weight
        return cls(config, embed.detach(), lm_head.detach())

    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (N, K, D) for positions (N, K)."""
        return rope_cos_sin(self.inv_freq, positions, dtype)


def paged_context_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, slots_pos: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Read K/V of positions `slots_pos` (N, S) from one layer of vLLM's CPU KV cache ("vec" ISA layout).

    kv_cache: (nb, Hkv, bs, 2D) as vLLM allocates it; inside one (block, head) the first bs*D numbers
    are the keys stored transposed (D, bs), the next bs*D the values (bs, D) (what
    `cpu_attn_reshape_and_cache` writes for the "vec" ISA). block_table: (N, max_blocks) int, the
    request's block ids. slots_pos: (N, S) long positions, >= 0. Returns k, v each (N, S, Hkv, D), K post-RoPE.
    """
    nb, hkv, bs, two_d = kv_cache.shape
    d = two_d // 2
    halves = kv_cache.view(nb, hkv, 2, bs * d)
    keys_t = halves[:, :, 0].view(nb, hkv, d, bs)  # key of token t: keys_t[b, h, :, t]
    values = halves[:, :, 1].view(nb, hkv, bs, d)
    blocks = block_table.long().gather(1, slots_pos // bs)  # (N, S)
    offsets = slots_pos % bs  # (N, S)
    # Advanced indices split by a slice: their (N, S) dims come first.
    return keys_t[blocks, :, :, offsets], values[blocks, :, offsets]  # (N, S, Hkv, D) x2


@dataclass(frozen=True)
class DraftRows:
    """The requests of one step that get drafts, and where their inputs are.

    requests: (N,) indices into the step's batch. hidden_rows: (N,) row of the last verified position in
    the step's forward. positions: (N,) p, the anchor's position (= the verified prefix length).
    anchors: (N,) x0, the last sampled token.
    """

    requests: torch.Tensor
    hidden_rows: torch.Tensor
    positions: torch.Tensor
    anchors: torch.Tensor


def draft_rows(sampled_token_ids: Sequence[Sequence[int]], query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               num_draft_tokens: Sequence[int] | None) -> DraftRows:
    """Which rows to draft from, after a step that verified `num_draft_tokens[i]` drafts of request i.

    Request i ran query rows [query_start_loc[i], query_start_loc[i+1]) ending at KV length seq_lens[i];
    it kept len(sampled[i]) - 1 drafts plus one sampled token, so num_draft + 1 - len(sampled) rows at the
    end were rejected. A request with nothing sampled (a prefill chunk that is not the last) gets no draft.
    """
    requests, rows, positions, anchors = [], [], [], []
    for i, sampled in enumerate(sampled_token_ids):
        if not sampled:
            continue
        drafted = num_draft_tokens[i] if num_draft_tokens is not None else 0
        rejected = drafted + 1 - len(sampled)
        requests.append(i)
        rows.append(int(query_start_loc[i + 1]) - 1 - rejected)
        positions.append(int(seq_lens[i]) - rejected)
        anchors.append(int(sampled[-1]))
    return DraftRows(*(torch.tensor(xs, dtype=torch.long) for xs in (requests, rows, positions, anchors)))


class HSpecProposer:
    """vLLM's custom-class proposer running hspec's H-Spec drafter (module docstring).

    Built by vLLM's runner as `HSpecProposer(vllm_config)`; `load_model(model)` gets the target once it
    is loaded; the plugin's patched runner then calls `propose_with_target` after every step.
    """

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.draft_length = DraftLength.of(vllm_config)
        self.K = self.draft_length.K
        self.checkpoint = drafter_path(vllm_config)
        info = read_checkpoint(self.checkpoint)
        if not issubclass(DRAFTERS.get(info.kind), HSpecDrafter):  # the family that reads the target's K/V in place
            family = sorted(kind for kind in DRAFTERS.names() if issubclass(DRAFTERS.get(kind), HSpecDrafter))
            raise ValueError(f"{self.checkpoint} holds a {info.kind!r} drafter; HSpecProposer serves the H-Spec "
                             f"family {family} (DFlash: vLLM's `dflash` method on an export, docs/vllm.md)")
        if not 1 <= self.K <= info.drafter_config.max_draft_len:
            raise ValueError(f"num_speculative_tokens={self.K}: the drafter at {self.checkpoint} drafts 1.."
                             f"{info.drafter_config.max_draft_len} tokens (its trained draft length)")
        # HF hidden-state indices = vLLM aux layers (the input of decoder layer l), ascending as vLLM returns them.
        self.aux_hidden_state_layers = tuple(info.drafter_config.target_layers)
        if list(self.aux_hidden_state_layers) != sorted(set(self.aux_hidden_state_layers)):
            raise ValueError(f"target_layers {self.aux_hidden_state_layers} must be ascending and distinct")
        self.drafter: NeuralDrafter | None = None
        self.adaptive: AdaptiveLength | None = None
        if self.draft_length.adaptive:
            self.adaptive = AdaptiveLength(self.K, step_cost_path(vllm_config, self.checkpoint, self.K),
                                           self.draft_length.step_cost)

    def load_model(self, model: Any) -> None:
        """Rebuild the drafter on vLLM's target (its embedding, LM head; hspec's RoPE), for inference."""
        view = VllmTargetView.of(model, self.vllm_config.model_config.model)
        drafter = load_drafter(self.checkpoint, view)  # type: ignore[arg-type]
        # As hspec's engine runs it: int8 linears under a bf16 target on a CPU (drafts only, never the output).
        self.drafter = prepare_for_inference(drafter, dtype_name(drafter.mask_embedding.dtype),
                                             drafter.mask_embedding.device)  # type: ignore[assignment]

    def propose(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        """vLLM's token-only custom-class call: H-Spec cannot draft from it (it needs the plugin's call)."""
        raise RuntimeError("HSpecProposer needs hidden states and the KV cache, which vLLM passes only through "
                           "hspec's plugin (entry point vllm.general_plugins: hspec); reinstall hspec "
                           "(`pip install -e .`) in vLLM's environment so the entry point is registered")

    def context_caches(self) -> list[torch.Tensor]:
        """KV caches (nb, Hkv, bs, 2D) of the target decoder layers the attention modules read, in module order."""
        context = self.vllm_config.compilation_config.static_forward_context
        by_index = {int(m.group(1)): layer for name, layer in context.items() if (m := _LAYER_NAME.search(name))}
        caches = []
        for decoder_layer in self.drafter_model.reused_kv_layers():
            layer = by_index[decoder_layer]
            isa = getattr(layer, "isa", None)
            if isa not in READABLE_ISAS:
                raise NotImplementedError(f"vLLM's CPU attention uses ISA {isa!r} here; HSpecProposer reads the "
                                          f"paged layout of {READABLE_ISAS} only (float32, or bf16 without AMX)")
            if not layer.kv_cache.is_floating_point() or layer.kv_cache.element_size() < 2:
                raise NotImplementedError(f"KV cache dtype {layer.kv_cache.dtype}: HSpecProposer reads unquantized "
                                          "K/V only (kv_cache_dtype='auto')")
            caches.append(layer.kv_cache)
        return caches

    @property
    def drafter_model(self) -> NeuralDrafter:
        if self.drafter is None:
            raise RuntimeError("HSpecProposer.load_model has not run: vLLM loads the drafter with the target")
        return self.drafter

    def block_context(self, rows: DraftRows, aux_hidden_states: Sequence[torch.Tensor],
                      block_table: torch.Tensor, K: int) -> BlockContext:
        """The H-Spec block inputs of `rows` for K drafts: hidden states of the tapped layers, paged target K/V."""
        drafter = self.drafter_model
        device = aux_hidden_states[0].device
        hidden_rows = rows.hidden_rows.to(device)
        last_hidden = torch.stack([h[hidden_rows] for h in aux_hidden_states], dim=1)  # (N, n_sel, H)
        positions_start = rows.positions.to(device)  # (N,) p
        block_tokens, positions = build_block(rows.anchors.to(device), positions_start, K,
                                              drafter.config.mask_token_id)  # (N, K) x2
        s = min(int(positions_start.max()), drafter.config.sliding_window)
        keys = positions_start[:, None] - s + torch.arange(s, device=device)  # (N, S), right-aligned
        table = block_table[rows.requests.to(block_table.device)].to(device)  # (N, max_blocks)
        context_kv = [paged_context_kv(cache, table, keys.clamp(min=0)) for cache in self.context_caches()]
        return BlockContext(block_tokens, positions, last_hidden, context_kv, keys >= 0)

    def propose_with_target(self, sampled_token_ids: Sequence[Sequence[int]],
                            aux_hidden_states: Sequence[torch.Tensor], common_attn_metadata: Any,
                            spec_decode_metadata: Any, req_ids: Sequence[str] | None = None) -> list[list[int]]:
        """Greedy drafts (`DraftLength`: K by default) per request of the step that sampled a token, [] for
        the others.

        sampled_token_ids: per request of the step, the tokens it kept (accepted drafts + the new one).
        aux_hidden_states: n_sel tensors (T, H), the tapped layers' outputs for every row of the step.
        common_attn_metadata: vLLM's `CommonAttentionMetadata` of the step (query_start_loc_cpu,
        seq_lens, block_table_tensor). spec_decode_metadata: vLLM's `SpecDecodeMetadata` or None.
        req_ids: the step's request ids in batch order (needed by the adaptive length, which follows requests).
        """
        if aux_hidden_states is None:
            raise RuntimeError("HSpecProposer got no aux hidden states: hspec's plugin did not turn them on")
        m = common_attn_metadata
        num_draft = spec_decode_metadata.num_draft_tokens if spec_decode_metadata is not None else None
        rows = draft_rows(sampled_token_ids, m.query_start_loc_cpu, m.seq_lens.cpu(), num_draft)
        if self.adaptive is not None:
            if req_ids is None:
                raise RuntimeError("hspec_draft_length='auto' needs the step's request ids from hspec's plugin")
            return self._propose_adaptive(self.adaptive, list(req_ids), sampled_token_ids, rows, aux_hidden_states,
                                          m, num_draft)
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        K = self.draft_length.per_request(rows.requests.numel())
        if rows.requests.numel() == 0 or K == 0:
            return out
        drafter = self.drafter_model
        ctx = self.block_context(rows, aux_hidden_states, m.block_table_tensor, K)
        local, confidence = drafter.draft_greedy(ctx, ctx.block_tokens[:, 0])  # (N, K) x2
        drafts = self.draft_length.trim(drafter.head.to_target_ids(local).tolist(), confidence)
        for request, tokens in zip(rows.requests.tolist(), drafts):
            out[request] = tokens
        return out

    def _propose_adaptive(self, adaptive: AdaptiveLength, req_ids: list[str],
                          sampled_token_ids: Sequence[Sequence[int]], rows: DraftRows,
                          aux_hidden_states: Sequence[torch.Tensor], m: Any,
                          num_draft: Sequence[int] | None) -> list[list[int]]:
        """`propose_with_target` under `hspec_draft_length='auto'` (`adaptive.AdaptiveLength`)."""
        starts = m.query_start_loc_cpu.tolist()
        verified = list(num_draft) if num_draft is not None else [0] * len(req_ids)
        adaptive.start_step(req_ids, [b - a for a, b in zip(starts, starts[1:])], verified,
                            [len(s) - 1 if s else None for s in sampled_token_ids])
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        lone = len(req_ids) == 1 and rows.requests.numel() == 1
        chosen = [i for i, request in enumerate(rows.requests.tolist())
                  if adaptive.wants_drafts(req_ids[request], lone)]
        if not chosen:
            adaptive.end_step(0 if lone else None, None)
            return out
        started = time.perf_counter()
        index = torch.tensor(chosen, dtype=torch.long)
        picked = DraftRows(*(x[index] for x in (rows.requests, rows.hidden_rows, rows.positions, rows.anchors)))
        drafter = self.drafter_model
        ctx = self.block_context(picked, aux_hidden_states, m.block_table_tensor, self.K)
        local, confidence = drafter.draft_greedy(ctx, ctx.block_tokens[:, 0])  # (N, K) x2
        drafts = drafter.head.to_target_ids(local).tolist()
        drafting_s = time.perf_counter() - started
        given = 0
        for request, tokens, sure, keys in zip(picked.requests.tolist(), drafts, confidence.float().tolist(),
                                               picked.positions.tolist()):
            given = adaptive.length(req_ids[request], sure, keys, lone)
            out[request] = tokens[:given]
        adaptive.end_step(given if lone else None, drafting_s)
        return out
