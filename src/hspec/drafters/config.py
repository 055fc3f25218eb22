"""What every trained drafter's configuration shares: the selected target layers, `DrafterConfig`, and
the parameter counts the kinds are sized against.

Kept apart from `common.py` so a building block (`block_attention.py`) can take a configuration
without importing the drafter base class that uses it.

Two layer numberings meet here. The target's hidden states are indexed as Hugging Face does
(0 = the embedding output, l = the output of decoder layer l), and the KV pool's target layers are
the decoder layers, 0-based: the K/V written while computing hidden state l live in pool layer
l - 1 (`kv_layer_of`).

Legend: L target layers, H hidden, Hq/Hkv heads, D head dim, I MLP width, V vocab, Vp pruned vocab,
r Markov rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from hspec.models.config import RopeScaling, TargetConfig

# ---- target layers ---------------------------------------------------------------------------------


def select_target_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """HF hidden-state indices of `count` evenly spaced target layers: floor(linspace(1, L-2, count)).

    Reproduces the paper's choices (App. B.1): Llama-3.1-8B (L=32) -> (1, 8, 15, 22, 30), Qwen3 (L=36)
    -> (1, 9, 17, 25, 34). Integer arithmetic gives the exact floor. Small targets may repeat a layer.
    """
    if num_layers < 3:
        raise ValueError(f"need a target with >= 3 layers to select from 1..L-2, got num_layers={num_layers}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if count == 1:
        return (1,)
    return tuple(1 + (i * (num_layers - 3)) // (count - 1) for i in range(count))


def kv_layer_of(hidden_layer: int) -> int:
    """Pool layer (0-based decoder layer) whose K/V belongs with HF hidden-state index l: l - 1."""
    if hidden_layer < 1:
        raise ValueError(f"hidden layer {hidden_layer} has no K/V (0 is the embedding output)")
    return hidden_layer - 1


# ---- configuration -----------------------------------------------------------------------------------

# Fields renamed since checkpoints were first written: old name -> current name. `from_dict` is the one
# place that reads the old names (config.json files already on disk, e.g. the shipped drafter).
_RENAMED_FIELDS = {"block_size": "max_draft_len"}


@dataclass(frozen=True)
class DrafterConfig:
    """A trained drafter's configuration, derived from the target it drafts for.

    Families subclass it to add their own fields (all with defaults). `to_dict`/`from_dict` round-trip
    it through JSON; `kind` tells a loader which drafter class (and config class) to use.
    """

    kind: str  # registered drafter kind
    target: TargetConfig  # the target the drafter was built for (dims, RoPE, vocabulary)
    target_layers: tuple[int, ...]  # M: HF hidden-state indices of the selected target layers
    draft_vocab_size: int  # Vp: pruned draft vocabulary (paper: 32,000 most frequent tokens)
    markov_rank: int = 256  # r of the DSpark Markov head; 0 = no Markov head
    max_draft_len: int = 7  # K_train: the draft length trained for; inference may use any K <= it
    sliding_window: int = 2048  # context keys visible to a block: positions p - window .. p - 1
    # Fields that change how a trained drafter decodes and none of its weights: the decoding commands'
    # --drafter-option may set them on a saved checkpoint (`hspec.runtime.build_drafter`).
    decoding_options: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        L = self.target.num_layers
        if not self.target_layers:
            raise ValueError("target_layers is empty; select at least one target layer")
        bad = [layer for layer in self.target_layers if not 1 <= layer <= L]
        if bad:
            raise ValueError(f"target_layers {bad} outside 1..{L} (the target's decoder layers)")
        if not 1 <= self.draft_vocab_size <= self.target.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.target.vocab_size}, got {self.draft_vocab_size}")
        for name in ("max_draft_len", "sliding_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0 = no Markov head), got {self.markov_rank}")

    @classmethod
    def from_target(cls, kind: str, target: TargetConfig, **overrides: Any) -> DrafterConfig:
        """The defaults for `target`: 5 selected layers, Vp = min(32000, V), then `overrides`."""
        fields: dict[str, Any] = {"target_layers": select_target_layers(target.num_layers),
                                  "draft_vocab_size": min(32000, target.vocab_size)}
        fields.update(overrides)
        return cls(kind=kind, target=target, **fields)

    # Target dimensions, by their usual names.
    hidden_size = property(lambda self: self.target.hidden_size)  # H
    num_heads = property(lambda self: self.target.num_heads)  # Hq
    num_kv_heads = property(lambda self: self.target.num_kv_heads)  # Hkv
    head_dim = property(lambda self: self.target.head_dim)  # D
    intermediate_size = property(lambda self: self.target.intermediate_size)  # I
    rms_norm_eps = property(lambda self: self.target.rms_norm_eps)
    vocab_size = property(lambda self: self.target.vocab_size)  # V

    @property
    def mask_token_id(self) -> int:
        """The MASK id, V: no target token has it; it selects the drafter's learned mask embedding."""
        return self.target.vocab_size

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DrafterConfig:
        """Inverse of `to_dict` (lists become tuples again); also reads configs saved under old field names."""
        raw = dict(raw)
        for old, new in _RENAMED_FIELDS.items():
            if old in raw:
                if new in raw:
                    raise ValueError(f"both {old!r} and its new name {new!r} given; keep only {new!r}")
                raw[new] = raw.pop(old)
        target = dict(raw.pop("target"))
        target["rope_scaling"] = RopeScaling(**target["rope_scaling"])
        target["eos_token_ids"] = tuple(target["eos_token_ids"])
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}; allowed: {sorted(known)}")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
        return cls(target=TargetConfig(**target), **values)


def dspark_trainable_params(config: DrafterConfig, num_layers: int = 5) -> int:
    """Trainable parameters of the DSpark baseline (docs/design.md#dflash-family) for `config`'s target, by formula.

    Per layer (Qwen3-style, no biases): q/k/v/o with the target's (Hq, Hkv, D), per-head q/k-norm (2D),
    SwiGLU with the target's I, 2 RMSNorms. Plus W_fc: n_sel*H -> H with its RMSNorm, the final RMSNorm,
    the learned MASK embedding (H), and the Markov head W1 (V x r) + W2 (r x Vp) when r > 0. The target's
    embedding and LM head are frozen and not counted.
    """
    H, Hq, Hkv, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    attention = H * Hq * D + 2 * H * Hkv * D + Hq * D * H + 2 * D
    layer = attention + 3 * H * config.intermediate_size + 2 * H
    fusion = len(config.target_layers) * H * H + H
    return num_layers * layer + fusion + H + H + markov_params(config)


def markov_params(config: DrafterConfig) -> int:
    """Parameters of the Markov head: W1 (V x r) + W2 (r x Vp); 0 without one."""
    r = config.markov_rank
    return config.vocab_size * r + r * config.draft_vocab_size if r else 0
