"""The target model's configuration, read from a Hugging Face `config.json`.

One frozen dataclass covers the Llama family this runtime implements: Llama 2/3.x (with rope
scaling), Qwen2/2.5 (qkv bias, untied head), Qwen3 (q/k-norm), Mistral and SmolLM2. Anything
else is refused at load with the list of what is supported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

# HF `architectures` entry -> (qkv bias, q/k-norm). Qwen2 always has a qkv bias; Qwen3 never does
# but normalises q and k per head before RoPE.
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are rescaled for long context (HF `rope_scaling`)."""

    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear / llama3 scale factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope scaling type {self.rope_type!r} is not supported; allowed: {SUPPORTED_ROPE_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class TargetConfig:
    """Dimensions of a Llama-family decoder (legend: H hidden, Hq/Hkv heads, D head dim, V vocab)."""

    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int  # V
    hidden_size: int  # H
    intermediate_size: int  # I, SwiGLU inner width
    num_layers: int  # L
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv (GQA: Hq % Hkv == 0)
    head_dim: int  # D
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096  # context limit enforced at admission
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"allowed: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> TargetConfig:
        """Build from a HF `config.json` dict (both the `rope_scaling` and `rope_parameters` spellings)."""
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else _architecture_from_model_type(raw)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {architecture!r} is not supported; allowed: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[architecture]
        qkv_bias = bool(raw.get("attention_bias", qkv_bias))
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        rope_raw = dict(raw.get("rope_parameters") or {})
        rope_raw.update(raw.get("rope_scaling") or {})
        rope_theta = float(rope_raw.get("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope_raw.get("rope_type", rope_raw.get("type", "default"))
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope_raw.get("factor", 1.0)),
            low_freq_factor=float(rope_raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope_raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rope_raw.get("original_max_position_embeddings", 8192)),
        )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            qk_norm=qk_norm,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _architecture_from_model_type(raw: dict[str, Any]) -> str:
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    model_type = raw.get("model_type")
    return by_type.get(str(model_type), f"<model_type {model_type!r}>")


def rope_inverse_frequencies(config: TargetConfig) -> torch.Tensor:
    """Per-pair rotary frequencies, shape (D/2,), fp32, after the configured scaling.

    Computed in fp32 the way the reference implementation does, so positions far into the context
    rotate identically. llama3 scaling (Llama 3.1 report): wavelengths longer than
    original_len / low_freq_factor are divided by `factor`, shorter than original_len / high_freq_factor
    are kept, and the band between is interpolated smoothly.
    """
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if s.rope_type == "linear":
        return inv_freq / s.factor
    if s.rope_type == "llama3":
        original = s.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        long_waves = wavelen > original / s.low_freq_factor
        short_waves = wavelen < original / s.high_freq_factor
        smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
        scaled = torch.where(long_waves, inv_freq / s.factor, interpolated)
        return torch.where(short_waves, inv_freq, scaled)
    return inv_freq
