"""On a CUDA GPU in bf16: greedy speculative output equals plain greedy output, for every drafter kind, and a
training step of every trained kind runs there (marked `gpu`; skipped where torch sees no CUDA device).

The README says the same code runs on a GPU; these check it on tiny random-weight targets, as the CPU suite
does (tests/test_generate.py), in the dtype a GPU runs: the target, its KV pool and the drafters in bf16.
scripts/gpu_recipe.sh runs them first on a GPU machine (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch

from conftest import load_tiny, random_sequence_features
from hspec.drafters import DRAFTERS, create_drafter
from hspec.drafters.common import NeuralDrafter
from hspec.sampling import SamplingParams
from test_generate import ALL_KINDS, PROMPTS, _decoder, _make

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEURAL_KINDS = [k for k in DRAFTERS.names() if issubclass(DRAFTERS.get(k), NeuralDrafter)]


@pytest.fixture(scope="module")
def cuda_bf16_target(tiny_dirs):
    """The tiny Llama-family target on the GPU in bf16 (its pool and drafters built on it follow)."""
    return load_tiny(tiny_dirs["llama"], "cuda", torch.bfloat16)


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("B,K", [(1, 7), (3, 4)])
def test_greedy_equals_plain_on_cuda_in_bf16(cuda_bf16_target, kind, B, K):
    target = cuda_bf16_target
    prompts = [target.tokenizer.encode_prompt(p) for p in PROMPTS[:B]]
    plain = _decoder(target, create_drafter("none", target.config), 1)
    drafter = _make(kind, target)
    if isinstance(drafter, torch.nn.Module):
        assert all(p.is_cuda for p in drafter.parameters())
    expected = plain.generate(prompts, SamplingParams(), 40)
    got = _decoder(target, drafter, K).generate(prompts, SamplingParams(), 40)
    for e, s in zip(expected.sequences, got.sequences):
        assert s.token_ids == e.token_ids and s.finish_reason == e.finish_reason
        assert all(0 <= n <= d <= K for n, d in zip(s.num_accepted, s.num_drafted, strict=True))


@pytest.mark.parametrize("kind", NEURAL_KINDS)
def test_a_training_step_of_every_kind_runs_on_cuda_in_bf16_autocast(tiny_dirs, kind):
    """One batched step (`make_step_batch`) with features on the GPU: finite loss, fp32 gradients there."""
    from hspec.training.trainer import TrainConfig, Trainer

    target = load_tiny(tiny_dirs["llama"], "cuda")  # fp32 master weights; the forward runs in bf16 autocast
    features = [f.to("cuda") for f in random_sequence_features(target)]
    torch.manual_seed(0)
    drafter = create_drafter(kind, target.config, target_model=target.model)
    config = TrainConfig(steps=2, seqs_per_step=3, anchors_per_seq=8, precision="bf16-autocast",
                         cod_keep=DRAFTERS.get(kind).trains_with_cod)
    trainer = Trainer(drafter, target.model, features.__getitem__, list(range(len(features))), config)
    log = trainer.train_step(0)
    assert torch.isfinite(torch.tensor(log.loss)) and log.grad_norm > 0
    assert all(p.is_cuda and p.dtype == torch.float32 for p in trainer.params)
