"""What each registered drafter kind costs for a target: parameters, drafter-side KV, per-sequence state.

For every kind in `DRAFTERS`, built for the target (on the `meta` device for the literal configs of
`hspec.models.kv_accounting`, so an 8B target needs no weights):

- trainable_params: the drafter's own parameters (the target's embedding and LM head are frozen);
- total_params: every parameter a drafter forward reads: its own plus the target's embedding and
  LM head it shares (counted once when they are tied); 0 for model-free kinds;
- drafter_kv_bytes_per_token: K/V the drafter keeps in the pool for every context token
  (num_drafter_layers x 2 x Hkv x D x bytes);
- per_sequence_state_bytes: what it keeps per sequence independent of the context length (the
  selected layers' hidden states at the last position, n_sel x H), not counting transient buffers
  of one step;
- kv_inflation: (target KV + drafter KV per token) / target KV (paper Table 1).

Legend: H hidden, V vocab, Hkv KV heads, D head dim, n_sel selected target layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from hspec.drafters import DRAFTERS, create_drafter
from hspec.drafters.base import Drafter
from hspec.models.config import TargetConfig
from hspec.models.kv_accounting import KNOWN_TARGETS, kv_bytes_per_token, kv_inflation
from hspec.models.llama import TargetModel

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class DrafterDescription:
    """One kind's costs for one target (see the module docstring for each field)."""

    kind: str
    target: str
    trainable_params: int
    total_params: int
    target_layers: list[int]  # target hidden-state layers the drafter reads (HF indexing)
    reused_kv_layers: list[int]  # target decoder layers (0-based) whose K/V it reads in place
    drafter_kv_layers: int  # layers of drafter-owned context KV in the pool
    drafter_kv_bytes_per_token: int
    per_sequence_state_bytes: int
    kv_inflation: float
    bytes_per_element: int

    def to_dict(self) -> dict:
        return asdict(self)


def build_target(name: str | None) -> tuple[str, TargetConfig, nn.Module]:
    """A target to describe drafters for: a literal config of `kv_accounting` (built on `meta`, no
    weights), or anything `load_target` accepts (default: the embedded SmolLM2)."""
    literal = {t.name: t for t in KNOWN_TARGETS}
    if name is not None and name.lower() in literal:
        config = literal[name.lower()].config
        with torch.device("meta"):
            model = TargetModel(config)
        return name.lower(), config, model
    from hspec.models.loading import load_target

    target = load_target(name)
    return target.name, target.config, target.model


def describe_drafter(drafter: Drafter, target_name: str, config: TargetConfig,
                     bytes_per_element: int = 2) -> DrafterDescription:
    """The costs of an instantiated drafter for the target `config`."""
    own = [p for p in drafter.parameters()] if isinstance(drafter, nn.Module) else []
    trainable = sum(p.numel() for p in own if p.requires_grad)
    shared = 0
    if drafter.needs_target_model:
        # The target's embedding and LM head, read in place (one matrix when tied).
        shared = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    drafter_kv = kv_bytes_per_token(drafter.num_drafter_layers, config.num_kv_heads, config.head_dim, bytes_per_element)
    state = len(drafter.target_layers) * config.hidden_size * bytes_per_element if own else 0
    return DrafterDescription(
        kind=drafter.kind, target=target_name, trainable_params=trainable,
        total_params=sum(p.numel() for p in own) + shared, target_layers=list(drafter.target_layers),
        reused_kv_layers=list(drafter.reused_kv_layers()) if hasattr(drafter, "reused_kv_layers") else [],
        drafter_kv_layers=drafter.num_drafter_layers, drafter_kv_bytes_per_token=drafter_kv,
        per_sequence_state_bytes=state, kv_inflation=kv_inflation(config, drafter_kv, bytes_per_element),
        bytes_per_element=bytes_per_element)


def describe_kinds(target: str | None = None, kinds: Sequence[str] | None = None, dtype: str = "bf16"
                   ) -> list[DrafterDescription]:
    """Describe `kinds` (default: every registered kind) for `target` (see `build_target`)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    name, config, model = build_target(target)
    rows = []
    for kind in kinds or DRAFTERS.names():
        drafter = create_drafter(kind, config, target_model=model)
        rows.append(describe_drafter(drafter, name, config, DTYPE_BYTES[dtype]))
        del drafter
    return rows


def format_descriptions(rows: Sequence[DrafterDescription]) -> str:
    """A Markdown table of `rows`."""
    lines = ["| kind | trainable params | total params | hidden layers read | target KV reused "
             "| drafter KV layers | drafter KV B/token | per-seq state B | KV inflation |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        layers = ", ".join(map(str, r.target_layers)) or "-"
        reused = ", ".join(map(str, r.reused_kv_layers)) or "-"
        lines.append(f"| {r.kind} | {r.trainable_params:,} | {r.total_params:,} | {layers} | {reused} | "
                     f"{r.drafter_kv_layers} | "
                     f"{r.drafter_kv_bytes_per_token:,} | {r.per_sequence_state_bytes:,} | {r.kv_inflation:.3f} |")
    return "\n".join(lines)
