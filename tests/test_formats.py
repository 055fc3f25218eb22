"""The weight formats (`models.formats`): each one's product keeps a row's bits alone or among others,
multiplies exactly the weights it stored, and a prompt's product is the floating product; what each
`quantize_*` walker stores in a model.

Greedy speculative decoding is lossless only if a row comes out the same bits whether it is computed
alone (a 1-token decode) or inside a (K+1)-token verify (models/formats/base.py).
"""

from __future__ import annotations

import pytest
import torch

from hspec.models.formats.base import StoredWeight
from hspec.models.formats.floating import FLOATING, FLOATING_PACKED, pack_weight, prepack_available
from hspec.models.formats.int4 import (
    INT4_HSPEC,
    INT4_TORCH,
    dequantize_groups,
    int4_kernel_fits,
    pack_int4,
    quantize_groups,
)
from hspec.models.formats.int8 import INT8_HSPEC, INT8_TORCH, quantize_rows
from hspec.models.formats.store import quantize_int4, quantize_int8
from hspec.models.formats.w4a8 import W4A8_FORMAT, W8A8_FORMAT, pack_w4a8, pack_w8a8
from hspec.models.native import load_kernels

# Weight formats (`models.formats`): floating, int8 and int4 for torch's kernels or hspec's
# (models/cpu_kernels.cpp), and w4a8's two (int4 and int8 weights times int8 rows; hspec's kernels only).
FORMATS = {"floating": FLOATING, "int8": INT8_TORCH, "int4": INT4_TORCH, "int8 hspec": INT8_HSPEC,
           "int4 hspec": INT4_HSPEC, "w4a8 hspec": W4A8_FORMAT, "w8a8 hspec": W8A8_FORMAT}


STORAGES = list(FORMATS)


def _linear(weight: torch.Tensor, storage: str) -> StoredWeight:
    """`weight` stored in `storage` (one of STORAGES) with its format, callable as a product."""
    return StoredWeight(FORMATS[storage], *_stored(weight, storage))


def _stored(weight: torch.Tensor, storage: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`weight` as `storage`'s format multiplies it (one of STORAGES), built from the packing functions:
    weight, scale, packed. An hspec storage skips the test where hspec's kernels do not run."""
    hspec = storage.endswith(" hspec")
    if hspec and not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here (no AVX2, or no compiler)")
    if storage == "w4a8 hspec":
        levels, scale = quantize_groups(weight, torch.bfloat16)
        step_offset, _ = pack_int4(levels, scale)
        return dequantize_groups(levels, scale, torch.bfloat16), step_offset, pack_w4a8(levels, scale)
    if storage == "w8a8 hspec":
        q, scale = quantize_rows(weight, torch.bfloat16)
        return q, scale, pack_w8a8(q)
    if storage.startswith("int8"):
        q, scale = quantize_rows(weight, torch.bfloat16)
        return q, scale, q if hspec else None
    if storage.startswith("int4"):
        levels, scale = quantize_groups(weight, torch.bfloat16)
        floating = dequantize_groups(levels, scale, torch.bfloat16)
        if hspec:
            return (floating, *pack_int4(levels, scale))
        return floating, scale, torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels.to(torch.int32), 1)
    return weight, None, None


# (48, 2112): 66 blocks of 32 inputs, more than the AVX2 w4a8 tile takes in one pass (kPassBlocks, cpu_kernels.cpp)
@pytest.mark.parametrize("out_features,in_features",
                         [(960, 576), (576, 1536), (3072, 576), (40, 48), (37, 64), (48, 2112)])
@pytest.mark.parametrize("storage", STORAGES)
def test_linear_computes_a_row_the_same_alone_or_among_others(out_features, in_features, storage):
    torch.manual_seed(0)
    weight = (torch.randn(out_features, in_features) * 0.05).to(torch.bfloat16)
    if storage.startswith(("int4", "w4a8")) and not int4_kernel_fits(weight):
        pytest.skip("the int4 kernels take inputs in groups of 32 and outputs in multiples of 16")
    if storage == "w8a8 hspec" and (in_features % 32 or out_features % 8):
        pytest.skip("the w8a8 kernel takes inputs in blocks of 32 and outputs in multiples of 8")
    if storage == "int8 hspec" and in_features % 32:
        pytest.skip("hspec's int8 kernel takes inputs in blocks of 32 (torch's takes the rest)")
    linear = _linear(weight, storage)
    x = torch.randn(1, 70, in_features).to(torch.bfloat16)  # more rows than one product takes (ROW_BLOCK)
    together = linear(x)  # (1, 70, out)
    alone = torch.cat([linear(x[:, i : i + 1]) for i in range(70)], dim=1)
    assert torch.equal(together, alone)
    for rows in (2, 5, 8, 32, 33, 65):
        assert torch.equal(linear(x[:, :rows]), together[:, :rows])


def test_a_product_autograd_records_runs_in_one_call():
    """Training (a drafter's step under bf16 autocast) needs no row invariance: its products are F.linear's
    in one call, however many rows (blocks of 32 would cost a training step time for nothing)."""
    torch.manual_seed(1)
    weight = (torch.randn(576, 1536) * 0.05).to(torch.bfloat16).requires_grad_()  # SmolLM2's down_proj
    x = torch.randn(100, 1536).to(torch.bfloat16)
    linear = StoredWeight(FLOATING, weight, None, None)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, weight))
    with torch.no_grad():  # inference: blocks of at most 32 rows, each row with the bits it has alone
        assert torch.equal(linear(x), torch.cat([linear(x[i : i + 1]) for i in range(100)]))


@pytest.mark.skipif(not prepack_available(), reason="this torch has no oneDNN packed linear")
@pytest.mark.parametrize("out_features,in_features", [(3072, 576), (960, 576), (576, 1536), (40, 48)])
def test_a_packed_weight_gives_f_linears_bits_alone_or_among_others(out_features, in_features):
    torch.manual_seed(3)
    weight = (torch.randn(out_features, in_features) * 0.05).to(torch.bfloat16)
    packed = pack_weight(weight)
    assert packed is not None and pack_weight(weight.float()) is None  # bf16 only
    bias = torch.randn(out_features).to(torch.bfloat16)
    x = torch.randn(1, 70, in_features).to(torch.bfloat16)
    together = FLOATING_PACKED(x, weight, bias, None, packed)
    assert torch.equal(together, FLOATING(x, weight, bias, None, None))
    alone = torch.cat([FLOATING_PACKED(x[:, i : i + 1], weight, bias, None, packed) for i in range(70)], dim=1)
    assert torch.equal(together, alone)


def test_a_bf16_target_is_prepacked_and_keeps_the_logits_of_plain_weights(tiny_dirs):
    from conftest import load_tiny
    from hspec.models.formats.store import drop_packed

    if not prepack_available():
        pytest.skip("this torch has no oneDNN packed linear")
    target = load_tiny(tiny_dirs["llama"], dtype=torch.bfloat16)
    model = target.model
    layer = model.layers[0]
    assert layer.self_attn.qkv.qkv_packed is not None and layer.mlp.gate_up_packed is not None
    assert layer.mlp.down_proj.weight_packed is not None and model.lm_head.weight_packed is not None
    assert layer.self_attn.qkv.q_proj.weight_packed is None  # a part of the stacked matrix: never used
    assert "lm_head.weight_packed" not in model.state_dict()
    ids = torch.tensor([[5, 9, 2, 7, 11, 3]])
    pool = model.new_pool(4)
    pool.add_sequence(0)
    packed_logits = model(ids, pool, [0]).logits
    drop_packed(model)  # the same model on F.linear
    assert layer.self_attn.qkv.qkv_packed is None and model.lm_head.weight_packed is None
    pool.truncate(0, 0)
    assert torch.equal(model(ids, pool, [0]).logits, packed_logits)
    assert load_tiny(tiny_dirs["llama"]).model.lm_head.weight_packed is None  # float32: nothing packed


@pytest.mark.parametrize("storage", ["int8 hspec", "int4 hspec"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_hspecs_kernels_compute_the_product_of_the_stored_weights(storage, rows):
    """hspec's int8 and int4 kernels multiply exactly the weights the storage says (int8 rows times their
    scale; level * step + offset), summed in fp32: float32 rows give the fp32 product to summation error,
    bf16 rows that product rounded to bf16."""
    torch.manual_seed(7)
    weight, scale, packed = _stored(torch.randn(80, 96) * 0.05, storage)
    linear = StoredWeight(FORMATS[storage], weight, scale, packed)
    if storage.startswith("int8"):
        exact = weight.float() * scale.float()[:, None]
    else:
        levels = torch.cat((packed & 15, packed >> 4), dim=-1).view(80, 96).float()  # inputs 0-15 low, 16-31 high
        step, offset = scale.repeat_interleave(32, dim=1).unbind(-1)  # (N, K) each
        exact = levels * step + offset
    x = torch.randn(rows, 96)
    assert torch.allclose(linear(x), x @ exact.T, rtol=1e-5, atol=1e-5)
    rounded = linear(x.bfloat16())
    assert rounded.dtype == torch.bfloat16
    assert torch.allclose(rounded.float(), (x.bfloat16().float() @ exact.T), rtol=1e-2, atol=1e-3)


def _int8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (M, K) -> their levels (M, K/32, 32) and steps (M, K/32, 1) as the w4a8 and w8a8 kernels round
    them: per block of 32, levels x * (127 / max |x|) in fp32 rounded to nearest even (bf16 rows often land
    on a tie), step max |x| / 127."""
    blocks = x.float().view(x.shape[0], -1, 32)
    most = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(most > 0, torch.full_like(most, 127.0) / most, 0.0)  # (127.0 / most is 127 * (1 / most))
    return torch.round(blocks * inverse), most / 127.0


@pytest.mark.parametrize("storage", ["w4a8 hspec", "w8a8 hspec"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_w4a8s_kernels_multiply_the_stored_weights_by_the_rows_rounded_to_int8_blocks(storage, rows):
    """The w4a8 and w8a8 kernels compute, to fp32 summation error, the product of the stored weights with
    the rows rounded to int8 blocks of 32 (`_int8_blocks`): a level off anywhere would show (~1e-3)."""
    torch.manual_seed(11)
    original = torch.randn(80, 96) * 0.05
    weight, scale, packed = _stored(original, storage)
    linear = StoredWeight(FORMATS[storage], weight, scale, packed)
    if storage == "w4a8 hspec":
        levels, steps = quantize_groups(original, torch.bfloat16)
        step, zero = steps.permute(1, 0, 2).double().repeat_interleave(32, dim=1).unbind(-1)  # (N, K) each
        exact = levels.double() * step + (zero - 8 * step)
    else:
        exact = weight.double() * scale.double()[:, None]
    for x in (torch.randn(rows, 96), torch.randn(rows, 96).bfloat16()):
        levels, steps = _int8_blocks(x)
        rounded = (levels.double() * steps.double()).view(rows, 96)
        got = linear(x)
        assert got.dtype == x.dtype
        tolerance = 1e-5 if x.dtype == torch.float32 else 8e-3  # bf16 output: half a bf16 step
        assert torch.allclose(got.double(), rounded @ exact.T, rtol=tolerance, atol=1e-5)
    zero_row = linear(torch.zeros(1, 96))  # max |x| = 0: no division by it
    assert torch.equal(zero_row, torch.zeros(1, 80))


def test_quantize_rows_bounds_the_error_by_half_a_step():
    torch.manual_seed(2)
    weight = torch.randn(30, 50)
    weight[3] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_rows(weight, torch.float32)
    assert q.dtype == torch.int8 and q.is_contiguous() and scale.shape == (30,)
    error = (q.float() * scale[:, None] - weight).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-6).all())
    assert int(q[3].abs().max()) == 0


def test_quantize_groups_bounds_the_error_by_half_a_step_and_keeps_a_q4_1_checkpoints_levels():
    torch.manual_seed(5)
    weight = torch.randn(32, 128) * 0.05
    weight[3, :32] = 0.25  # a constant group must not divide by zero
    levels, scale = quantize_groups(weight, torch.float32)
    assert levels.dtype == torch.uint8 and scale.shape == (4, 32, 2) and int(levels.max()) <= 15
    step = scale[..., 0].T.repeat_interleave(32, dim=1)  # (N, K) each weight's step
    assert bool(((dequantize_groups(levels, scale, torch.float32) - weight).abs() <= step / 2 + 1e-6).all())
    assert torch.equal(dequantize_groups(levels[3:4, :32], scale[:1, 3:4], torch.float32), weight[3:4, :32])
    # A Q4_1 block: w = d q + m with q spanning 0..15 and d, m as the checkpoint stores them (fp16).
    q = torch.randint(0, 16, (32, 128))
    q[:, ::32], q[:, 1::32] = 0, 15
    d = (torch.rand(32, 4) * 0.01 + 0.001).half().float()
    m = (-torch.rand(32, 4) * 0.05).half().float()
    checkpoint = d.repeat_interleave(32, dim=1) * q + m.repeat_interleave(32, dim=1)
    for scale_dtype in (torch.float32, torch.bfloat16):  # bf16 rounds the steps, not the levels
        assert torch.equal(quantize_groups(checkpoint, scale_dtype)[0], q.to(torch.uint8))


@pytest.mark.parametrize("storage", ["int4", "int4 hspec"])
def test_an_int4_weight_is_the_kernels_weights_and_a_prefill_multiplies_it(storage):
    torch.manual_seed(6)
    weight, scale, packed = _stored(torch.randn(96, 64) * 0.05, storage)
    int4 = FORMATS[storage]
    eye = torch.eye(64, dtype=torch.bfloat16)
    assert torch.equal(int4(eye, weight, None, scale, packed).T, weight)  # the kernel's weights, bit for bit
    x = torch.randn(3, 40, 64).bfloat16()
    wide = int4.prefill(x, weight, None, scale, packed)
    assert torch.equal(wide, torch.nn.functional.linear(x, weight))
    kernel = int4(x, weight, None, scale, packed)
    assert torch.allclose(wide.float(), kernel.float(), atol=0.05, rtol=0.02)


def test_quantize_int4_stores_what_its_kernel_takes_and_leaves_the_rest_to_int8(tiny_dirs):
    from torch import nn

    from conftest import load_tiny
    from hspec.models.layers import Linear

    odd = nn.Sequential(Linear(64, 40, bias=False), Linear(48, 64, bias=False), Linear(64, 48, bias=True))
    odd.to(torch.bfloat16).requires_grad_(False)
    assert quantize_int4(odd) == 1  # 40 outputs and 48 inputs do not fit
    quantize_int8(odd)
    assert [m.weight.dtype for m in odd] == [torch.int8, torch.int8, torch.bfloat16]
    assert odd[2].weight_packed.dtype == torch.uint8 and odd[2].weight_scale.shape == (2, 48, 2)
    assert odd[2](torch.randn(3, 64).bfloat16()).shape == (3, 48)

    model = load_tiny(tiny_dirs["llama"], dtype="int4").model
    assert model.dtype_name == "int4" and model.lm_head.weight.dtype == torch.int8  # the head stays int8
    reference = load_tiny(tiny_dirs["llama"], dtype="bfloat16").model
    assert set(model.state_dict()) == set(reference.state_dict())
    qkv, mlp = model.layers[0].self_attn.qkv, model.layers[0].mlp
    assert qkv.qkv_packed.dtype == torch.uint8 and mlp.gate_up_packed.dtype == torch.uint8
    assert qkv.qkv_weight.dtype == torch.bfloat16  # the levels' values, what a prefill multiplies
    assert qkv.k_proj.weight.untyped_storage().data_ptr() == qkv.qkv_weight.untyped_storage().data_ptr()
    q_rows = qkv.q_proj.weight.shape[0]
    if load_kernels():  # hspec's layout: levels (N, K/32, 16), steps and offsets (N, K/32, 2) in fp32
        assert qkv.qkv_packed.shape == (qkv.qkv_weight.shape[0], 2, 16) and qkv.qkv_scale.dtype == torch.float32
        assert torch.equal(qkv.k_proj.weight_scale, qkv.qkv_scale[q_rows : q_rows + 32])
    else:  # torch's: steps and zeros (K/32, N, 2)
        assert torch.equal(qkv.k_proj.weight_scale, qkv.qkv_scale[:, q_rows:][:, :32])
    assert mlp.down_proj.weight_packed.dtype == torch.uint8


def test_a_w4a8_target_holds_int4s_weights_for_the_integer_kernels_and_needs_them(tiny_dirs):
    """--dtype w4a8: the decoder layers' weights are int4's (the same floating values, steps and offsets)
    in the w4a8 kernel's tiles, the LM head int8 in the w8a8 kernel's; without hspec's kernels it is refused
    by name (torch has no kernel for it)."""
    from conftest import load_tiny, skip_without_kernels
    from hspec.models.loading import build_model, read_state_dict

    skip_without_kernels("w4a8")
    w4a8 = load_tiny(tiny_dirs["llama"], dtype="w4a8").model
    int4 = load_tiny(tiny_dirs["llama"], dtype="int4").model
    assert w4a8.dtype_name == "w4a8" and int4.dtype_name == "int4"
    gate_up = (w4a8.layers[0].mlp, int4.layers[0].mlp)
    assert torch.equal(gate_up[0].gate_up_weight, gate_up[1].gate_up_weight)
    assert torch.equal(gate_up[0].gate_up_scale, gate_up[1].gate_up_scale)
    assert gate_up[0].gate_up_packed.shape == (gate_up[0].gate_up_weight.shape[0] // 8, 2, 160)
    head = w4a8.lm_head
    assert head.weight.dtype == torch.int8 and head.weight_packed.shape == (96 // 8, 2, 256)
    assert torch.equal(head.weight, int4.lm_head.weight)
    with pytest.raises(ValueError, match="--dtype w4a8 runs only in hspec's CPU kernels"):
        build_model(w4a8.config, read_state_dict(tiny_dirs["llama"]), "w4a8", "cpu", kernels=False)


def test_quantize_int8_leaves_floating_the_widths_the_kernel_cannot_take():
    from torch import nn

    from hspec.models.layers import Linear

    model = nn.Sequential(Linear(24, 40, bias=False), Linear(32, 40, bias=False))
    model.to(torch.bfloat16).requires_grad_(False)
    quantize_int8(model)
    assert model[0].weight.dtype == torch.bfloat16 and model[0].weight_scale is None
    assert model[1].weight.dtype == torch.int8
    assert model[0](torch.randn(3, 24).to(torch.bfloat16)).shape == (3, 40)
    assert model[1](torch.randn(3, 32).to(torch.bfloat16)).shape == (3, 40)


def test_quantize_int8_keeps_names_shares_stacked_rows_and_unties_the_head(tiny_dirs):
    from conftest import load_tiny

    target = load_tiny(tiny_dirs["llama"], dtype="bfloat16")
    model = target.model
    names = set(model.state_dict())
    embedding = model.embed_tokens.weight.clone()
    quantize_int8(model)
    assert set(model.state_dict()) == names
    qkv = model.layers[0].self_attn.qkv
    assert qkv.qkv_weight.dtype == torch.int8 and qkv.q_proj.weight.dtype == torch.int8
    assert qkv.q_proj.weight.untyped_storage().data_ptr() == qkv.qkv_weight.untyped_storage().data_ptr()
    assert model.lm_head.weight.dtype == torch.int8
    assert torch.equal(model.embed_tokens.weight, embedding)  # lookups keep the floating rows
    if model.config.tie_word_embeddings:
        assert model.lm_head_weight() is model.embed_tokens.weight
    with pytest.raises(ValueError, match="frozen"):
        trainable = load_tiny(tiny_dirs["llama"], dtype="bfloat16").model.requires_grad_(True)
        quantize_int8(trainable)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_a_prompts_int8_product_is_the_floating_product_of_the_rounded_weight(native_bf16):
    """A prefill multiplies the dequantized weight in one call: in bf16 where the CPU has bf16 dot products,
    in fp32 where torch would emulate bf16 (an AVX2-only CPU), rounded back to bf16 either way."""
    torch.manual_seed(0)
    w = torch.randn(96, 64) * 0.05
    q, scale = quantize_rows(w, torch.bfloat16)
    x = torch.randn(3, 40, 64).bfloat16()

    def floating_product(weight: torch.Tensor) -> torch.Tensor:
        if native_bf16:
            return torch.nn.functional.linear(x, weight)
        return torch.nn.functional.linear(x.float(), weight.float()).bfloat16()

    wide = INT8_TORCH.prefill(x, q, None, scale, None, native_bf16=native_bf16)
    assert torch.equal(wide, floating_product(q.bfloat16() * scale[:, None]))
    kernel = INT8_TORCH(x, q, None, scale, None)
    assert not torch.equal(wide, kernel) and torch.allclose(wide.float(), kernel.float(), atol=0.05, rtol=0.02)
    floating = torch.randn(96, 64).bfloat16()
    assert torch.equal(FLOATING.prefill(x, floating, None, None, None, native_bf16), floating_product(floating))


@pytest.mark.parametrize("dtype", ["int8", "int4", "w4a8"])
def test_weight_only_dtypes_are_refused_off_the_cpu(dtype):
    from hspec.models.loading import load_target

    with pytest.raises(ValueError, match=f"--dtype {dtype}"):
        load_target("smollm2", dtype=dtype, device="meta")


def test_a_model_runs_hspecs_kernels_or_torchs_throughout(tiny_dirs):
    from conftest import load_tiny
    from hspec.models.layers import RMSNorm
    from hspec.models.loading import build_model, read_state_dict

    if not load_kernels():
        pytest.skip("hspec's CPU kernels do not run here")
    ours = load_tiny(tiny_dirs["llama"], dtype="int4").model
    theirs = build_model(ours.config, read_state_dict(tiny_dirs["llama"]), "int4", "cpu", kernels=False)
    norms = [m for m in ours.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernel for m in norms) and ours.native.kernels
    assert not any(m.kernel for m in theirs.modules() if isinstance(m, RMSNorm)) and not theirs.native.kernels
    assert ours.layers[0].mlp.gate_up_packed.dim() == 3 and theirs.layers[0].mlp.gate_up_packed.dim() == 2
    assert ours.lm_head.weight_packed is not None and theirs.lm_head.weight_packed is None
    pool_a, pool_b = ours.new_pool(num_pages=4), theirs.new_pool(num_pages=4)
    pool_a.add_sequence(0)
    pool_b.add_sequence(0)
    with torch.inference_mode():
        a = ours(torch.tensor([[3, 4, 5]]), pool_a, [0]).logits
        b = theirs(torch.tensor([[3, 4, 5]]), pool_b, [0]).logits
    assert torch.allclose(a.float(), b.float(), atol=0.05, rtol=0.05)  # the same weights, other roundings
