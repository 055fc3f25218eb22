"""The Llama-family decoder in plain PyTorch: what the runtime computes, to read top to bottom.

This is the reference, not the runtime. `models/llama.py` computes the same function over the paged KV pool,
with stacked projections, weight formats (`models.formats`), products that keep a row's bits, and the
native C++ stack; every one of those is tested against this file (tests/test_reference.py), which holds
none of them: one full causal forward over the whole sequence, float32, no cache. One decoder covers Llama
2/3 (RoPE scaling), Mistral, Qwen2 (bias on q/k/v), Qwen3 (RMSNorm on each head's q and k) and SmolLM2
(tied head); parameter names are the Hugging Face checkpoints' without the `model.` prefix.

Legend: B batch, T tokens, V vocab, H hidden, I MLP width, Hq/Hkv query/KV heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hspec.models.config import TargetConfig, rope_inverse_frequencies


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps), times a learned weight per feature."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = x.pow(2).mean(-1, keepdim=True).add(self.eps).rsqrt()  # (..., 1)
        return self.weight * (x * rms)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, half-split convention: feature i pairs with i + D/2 and the pair turns by position x angle_i.
    x (B, heads, T, D); cos, sin (T, D)."""
    x1, x2 = x.chunk(2, dim=-1)  # (B, heads, T, D/2) each
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Grouped-query causal self-attention: Hq query heads share Hkv key/value heads."""

    def __init__(self, c: TargetConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        # Qwen3 normalises each head's q and k before the rotation
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)  # (B, T, Hq, D)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # heads first: (B, heads, T, D)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # each group of Hq / Hkv query heads reads one KV head
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, Hq, T, D)
        scores = q @ k.transpose(-2, -1) * self.head_dim**-0.5  # (B, Hq, T, T)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()  # token i sees tokens 0..i
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # (B, Hq, T, T)
        out = weights @ v  # (B, Hq, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # (B, T, H)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, c: TargetConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, I) -> (B, T, H)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the MLP, each added to the stream it read."""

    def __init__(self, c: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)  # (B, T, H)
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, T, H)


class ReferenceDecoder(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, V), every position seeing the ones before it."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)  # (D/2,)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        angles = torch.arange(t, device=input_ids.device).float()[:, None] * self.inv_freq  # (T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, D): both halves of a pair turn by the same angle
        cos, sin = angles.cos(), angles.sin()
        x = self.embed_tokens(input_ids)  # (B, T, H)
        for layer in self.layers:
            x = layer(x, cos, sin)  # (B, T, H)
        return self.lm_head(self.norm(x))  # (B, T, V)


def load_reference(config: TargetConfig, hf_state: dict[str, torch.Tensor]) -> ReferenceDecoder:
    """A reference decoder holding a checkpoint's tensors (`loading.read_state_dict`), in float32."""
    model = ReferenceDecoder(config)
    state = {key.removeprefix("model."): tensor.float() for key, tensor in hf_state.items() if "rotary_emb" not in key}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state)
    return model.eval().requires_grad_(False)
