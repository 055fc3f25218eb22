"""Golden tests: our runtime's logits equal transformers' own implementation (fp32, <= 1e-4)."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES, load_tiny


def _hf_logits(directory, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_full_forward_matches_transformers(tiny_dirs, family):
    target = load_tiny(tiny_dirs[family])
    ids = torch.randint(0, target.config.vocab_size, (2, 150), generator=torch.Generator().manual_seed(1))
    reference = _hf_logits(tiny_dirs[family], ids)
    pool = target.model.new_pool(num_pages=32, page_size=16)
    for s in (0, 1):
        pool.add_sequence(s)
    with torch.no_grad():
        ours = target.model(ids, pool, [0, 1]).logits
    assert (ours - reference).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_matches_full_forward(tiny_dirs, family):
    """Prefill, then chunks of 1 and 8 tokens through the pool, equals one full forward."""
    target = load_tiny(tiny_dirs[family])
    ids = torch.randint(0, target.config.vocab_size, (1, 90), generator=torch.Generator().manual_seed(2))
    reference = _hf_logits(tiny_dirs[family], ids)
    pool = target.model.new_pool(num_pages=16, page_size=8)
    pool.add_sequence(7)
    pieces, start = [], 0
    with torch.no_grad():
        for size in (41, 1, 8, 1, 1, 30, 8):
            pieces.append(target.model(ids[:, start:start + size], pool, [7]).logits)
            start += size
    assert start == 90
    assert (torch.cat(pieces, 1) - reference).abs().max().item() <= 1e-4


def test_hidden_states_match_transformers(tiny_dirs):
    from transformers import AutoModelForCausalLM

    target = load_tiny(tiny_dirs["qwen3"])
    ids = torch.randint(0, target.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dirs["qwen3"]), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states
        pool = target.model.new_pool(num_pages=4, page_size=8)
        pool.add_sequence(0)
        out = target.model(ids, pool, [0], hidden_layers=(0, 1, 3))
    for j, layer in enumerate((0, 1, 3)):
        assert (out.hidden[:, :, j] - ref[layer]).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(smollm2.path), dtype=torch.float32).eval()
    for prompt in ("What is the capital of France?", "def fibonacci(n):", "Explain photosynthesis briefly."):
        ids = torch.tensor([smollm2.tokenizer.encode_prompt(prompt)])
        with torch.no_grad():
            reference = hf(ids).logits
            pool = smollm2.model.new_pool(num_pages=8)
            pool.add_sequence(0)
            ours = smollm2.model(ids, pool, [0]).logits
        assert (ours - reference).abs().max().item() <= 1e-4
