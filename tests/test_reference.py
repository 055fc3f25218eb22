"""Every weight format against the plain reference decoder (models/reference.py).

The reference is first checked against transformers' own implementation; then each `--dtype` the runtime
loads runs a prompt's prefill, decodes and a verify through the pool, and its logits are compared with the
reference's full forward over the same tokens, with the weights that format stores (a quantized weight
dequantized in float32). What is left is the rounding of the rows between the products: none in float32,
bf16's (8 bits of mantissa) in bfloat16, int8 and int4, and w4a8's int8 rounding of each product's input
rows on top; each format's tolerance says so.
"""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, load_tiny
from hspec.models.llama import TargetModel
from hspec.models.loading import read_config, read_state_dict
from hspec.models.reference import ReferenceDecoder, load_reference

# Largest |runtime - reference| over the compared logits, as a fraction of the reference's largest |logit|
# (measured on these tiny targets: float32 4e-7, bf16 rows 4-8e-3, w4a8 4e-3-1e-2): float32 differs only in
# the order of its sums; a bf16 row carries ~3 significant digits through each layer; w4a8 also rounds every
# product's input rows to int8 blocks (a step max|x| / 127).
TOLERANCE = {"float32": 1e-5, "bfloat16": 0.03, "int8": 0.03, "int4": 0.03, "w4a8": 0.04}


def _ids(vocab_size: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))  # (1, n)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_reference_is_transformers_forward(tiny_dirs, family):
    from transformers import AutoModelForCausalLM

    directory = tiny_dirs[family]
    config = read_config(directory)
    reference = load_reference(config, read_state_dict(directory))
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    ids = torch.cat([_ids(config.vocab_size, 60, 1), _ids(config.vocab_size, 60, 2)])  # (2, 60)
    with torch.no_grad():
        assert (reference(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def _stored_floating_weights(model: TargetModel) -> dict[str, torch.Tensor]:
    """The weights a loaded target multiplies, as floating float32 tensors under the reference's names: each
    linear's `floating_weight` through its format (the stacked q/k/v and gate/up split back into parts)."""
    def floating(weight_format, weight, scale) -> torch.Tensor:
        return weight_format.floating_weight(weight, scale, torch.float32).float()

    state = {"embed_tokens.weight": model.embed_tokens.weight.float(), "norm.weight": model.norm.weight.float(),
             "lm_head.weight": floating(model.lm_head.weight_format, model.lm_head.weight, model.lm_head.weight_scale)}
    for i, layer in enumerate(model.layers):
        prefix = f"layers.{i}."
        qkv, mlp, o_proj = layer.self_attn.qkv, layer.mlp, layer.self_attn.o_proj
        parts = {"self_attn.q_proj": qkv.q_proj, "self_attn.k_proj": qkv.k_proj, "self_attn.v_proj": qkv.v_proj,
                 "mlp.gate_proj": mlp.gate_proj, "mlp.up_proj": mlp.up_proj}
        for name, part in parts.items():  # unstacked weights first; a stacked matrix overrides them below
            state[prefix + name + ".weight"] = floating(part.weight_format, part.weight, part.weight_scale)
            if part.bias is not None:
                state[prefix + name + ".bias"] = part.bias.float()
        if qkv.qkv_weight is not None:
            stacked = floating(qkv.qkv_format, qkv.qkv_weight, qkv.qkv_scale)  # ((Hq + 2 Hkv) D, H)
            sizes = [qkv.q_proj.weight.shape[0], qkv.k_proj.weight.shape[0], qkv.v_proj.weight.shape[0]]
            for name, rows in zip(("q_proj", "k_proj", "v_proj"), stacked.split(sizes)):
                state[f"{prefix}self_attn.{name}.weight"] = rows
        if mlp.gate_up_weight is not None:
            gate, up = floating(mlp.gate_up_format, mlp.gate_up_weight, mlp.gate_up_scale).chunk(2)  # (I, H) each
            state[prefix + "mlp.gate_proj.weight"], state[prefix + "mlp.up_proj.weight"] = gate, up
        state[prefix + "self_attn.o_proj.weight"] = floating(o_proj.weight_format, o_proj.weight, o_proj.weight_scale)
        state[prefix + "mlp.down_proj.weight"] = floating(mlp.down_proj.weight_format, mlp.down_proj.weight,
                                                          mlp.down_proj.weight_scale)
        state[prefix + "input_layernorm.weight"] = layer.input_layernorm.weight.float()
        state[prefix + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.float()
        if qkv.q_norm is not None and qkv.k_norm is not None:
            state[prefix + "self_attn.q_norm.weight"] = qkv.q_norm.weight.float()
            state[prefix + "self_attn.k_norm.weight"] = qkv.k_norm.weight.float()
    return state


@pytest.mark.parametrize("family,dtype", [(family, "float32") for family in FAMILIES]
                         + [("llama", dtype) for dtype in ("bfloat16", "int8", "int4", "w4a8")]
                         + [("qwen2", "int8"), ("qwen3", "w4a8")])
def test_every_format_matches_the_reference(tiny_dirs, family, dtype):
    """A prompt's prefill (`TargetModel.prefill`), 6 one-token decodes and a 5-token verify (`forward`)
    against the reference's one forward over the same 51 tokens, with the weights the format stores."""
    target = load_tiny(tiny_dirs[family], dtype=dtype)
    model = target.model
    reference = ReferenceDecoder(target.config)
    reference.load_state_dict(_stored_floating_weights(model))
    ids = _ids(target.config.vocab_size, 51, 3)  # (1, 51)
    pool = model.new_pool(num_pages=8, page_size=16)
    pool.add_sequence(0)
    with torch.inference_mode():
        logits = [model.prefill(ids[:, :40], pool, [0]).logits]  # (1, 40, V)
        logits += [model(ids[:, t : t + 1], pool, [0]).logits for t in range(40, 46)]  # (1, 1, V) each
        logits.append(model(ids[:, 46:], pool, [0]).logits)  # (1, 5, V)
        expected = reference(ids)  # (1, 51, V)
    got = torch.cat(logits, dim=1).float()
    error = (got - expected).abs().max().item() / expected.abs().max().item()
    assert error <= TOLERANCE[dtype], f"{dtype}: max error {error:.2e} of the largest logit"
