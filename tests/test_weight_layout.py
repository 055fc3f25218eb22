"""Linear weights stored column-major: same values, ties kept, same outputs, applied to targets and drafters."""

from __future__ import annotations

import torch
from torch import nn

from hspec.models.weight_layout import store_linear_weights_column_major


def _is_column_major(weight: torch.Tensor) -> bool:
    return weight.t().is_contiguous() and not weight.is_contiguous()


def test_values_kept_ties_kept_outputs_equal():
    torch.manual_seed(0)
    shared = nn.Linear(6, 10, bias=False)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), shared)
    twin = nn.Linear(6, 10, bias=False)
    twin.weight = shared.weight  # a tied weight, as an LM head tied to its embedding
    model.append(nn.Identity())
    model.twin = twin
    x = torch.randn(3, 4)
    before = model[:3](x)
    values = [p.detach().clone() for p in model.parameters()]
    store_linear_weights_column_major(model)
    assert all(torch.equal(a, b) for a, b in zip(values, model.parameters()))
    assert _is_column_major(model[0].weight) and _is_column_major(shared.weight)
    assert model.twin.weight is shared.weight
    assert torch.allclose(model[:3](x), before, atol=1e-6)
    store_linear_weights_column_major(model)  # idempotent
    assert _is_column_major(model[0].weight)


def test_embedding_tied_to_a_linear_keeps_sharing_it():
    embed = nn.Embedding(10, 6)
    head = nn.Linear(6, 10, bias=False)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    rows = embed(torch.tensor([1, 7])).detach().clone()
    store_linear_weights_column_major(model)
    assert model["embed"].weight is model["head"].weight and _is_column_major(model["head"].weight)
    assert torch.equal(model["embed"](torch.tensor([1, 7])), rows)


def test_tied_tiny_target_keeps_its_tie(tiny_dirs):
    from conftest import load_tiny

    tied = [name for name in tiny_dirs if load_tiny(tiny_dirs[name]).config.tie_word_embeddings]
    assert tied
    target = load_tiny(tiny_dirs[tied[0]])
    assert target.model.embed_tokens.weight is target.model.lm_head.weight
    assert _is_column_major(target.model.lm_head.weight)


def test_loaded_target_and_drafter_use_it(tiny_dirs, tmp_path):
    from conftest import load_tiny
    from hspec.runtime import build_drafter
    from hspec.training.checkpoint import save_drafter

    target = load_tiny(tiny_dirs["llama"])
    linears = [m for m in target.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(_is_column_major(m.weight) for m in linears)
    if target.config.tie_word_embeddings:
        assert target.model.embed_tokens.weight is target.model.lm_head.weight
    drafter = build_drafter("hspec", target, random_weights=True)
    own = [m for m in drafter.modules() if isinstance(m, nn.Linear)]
    assert own and all(_is_column_major(m.weight) for m in own)
    save_drafter(drafter, tmp_path / "d", verifier_name_or_path="tiny", verifier_architectures=["LlamaForCausalLM"])
    assert build_drafter("hspec", target, tmp_path / "d").kind == "hspec"


def test_decode_bench_times_both_layouts(tiny_target):
    from hspec.bench.decode import VERIFY_KS, _layout_costs

    times = _layout_costs(tiny_target.model, list(range(3, 20)), rounds=2)
    sizes = [1, *(k + 1 for k in VERIFY_KS)]
    assert set(times) == {"row", "column"}
    assert all(list(per_n) == sizes and all(len(v) == 2 and min(v) > 0 for v in per_n.values())
               for per_n in times.values())
    linears = [m for m in tiny_target.model.modules() if isinstance(m, nn.Linear)]
    assert all(_is_column_major(m.weight) for m in linears)  # the runtime's model keeps its layout
