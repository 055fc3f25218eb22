"""DFlash-2: the two-tap dynamic convolutions, the path selector and its training loss.

Losslessness, save/load, the engine schedule and describe/kv-table rows come from the suites
parametrised over the registry; test_dfly.py checks that `propose` draws from the teacher-forced
selector logits (greedy and sampled) and that a few training steps lower the loss.
"""

from __future__ import annotations

import pytest
import torch

from hspec.drafters import create_drafter
from hspec.drafters.base import DraftBatch
from hspec.drafters.common import kv_layer_of, select_target_layers
from hspec.drafters.dflash2 import DFlash2Config, DFlash2Drafter, dflash2_trainable_params, two_tap_conv
from hspec.models.kv_accounting import known_target
from hspec.models.llama import TargetModel
from hspec.sampling import SamplingBatch, SamplingParams
from hspec.training.features import compute_features
from hspec.training.trainer import make_batch


@pytest.fixture(scope="module")
def feats(tiny_target):
    layers = select_target_layers(tiny_target.config.num_layers)
    tokens = torch.randint(3, tiny_target.config.vocab_size, (50,), generator=torch.Generator().manual_seed(1))
    return compute_features(tiny_target.model, tokens.tolist(), 10, layers, [kv_layer_of(x) for x in layers])


def perturbed(drafter, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return drafter.eval()


def test_params_formula_and_config_validation():
    config = known_target("qwen3-8b").config
    with torch.device("meta"):
        drafter = DFlash2Drafter(config, TargetModel(config))
    assert drafter.num_trainable_params() == dflash2_trainable_params(drafter.config)
    assert drafter.markov is None and drafter.num_drafter_layers == 5
    bad_values = {"conv_group_size": 7, "selector_candidates": 0, "selector_rank": 0, "selector_loss_weight": -1.0}
    for name, value in bad_values.items():
        with pytest.raises(ValueError, match=name):
            DFlash2Config.from_target("dflash2", config, **{name: value})


def test_two_tap_conv_is_the_formula_and_stays_inside_the_block():
    g = torch.Generator().manual_seed(0)
    N, K, H = 2, 5, 8
    x, base = torch.randn(N, K, H, generator=g), torch.randn(2, H, generator=g)
    delta = torch.randn(N, K, 2, H, generator=g)
    out = two_tap_conv(x, base, delta)
    for i in range(K):
        expected = (base[0] + delta[:, i, 0]) * x[:, i]
        if i > 0:
            expected = expected + (base[1] + delta[:, i, 1]) * x[:, i - 1]
        torch.testing.assert_close(out[:, i], expected)
    identity = torch.stack([torch.ones(H), torch.zeros(H)])
    torch.testing.assert_close(two_tap_conv(x, identity, torch.zeros_like(delta)), x)


@torch.no_grad()
def test_untrained_convolutions_and_selector_are_dflash(tiny_target, feats):
    """At init the convolutions are the identity and B = 0, so the selector walks U's argmax."""
    torch.manual_seed(0)
    drafter = create_drafter("dflash2", tiny_target.config, target_model=tiny_target.model).eval()
    batch = make_batch(drafter, tiny_target.model, feats, torch.tensor([12, 25, 40]), 6)
    u = drafter.block_logits(batch.ctx)
    s = drafter.teacher_forced_logits(batch.ctx, batch.prev_tokens)
    assert torch.equal(s.argmax(-1), u.argmax(-1))
    assert bool((torch.isfinite(s).sum(-1) == drafter.config.selector_candidates).all())
    layer = drafter.layers[0]
    z = torch.randn(2, 6, tiny_target.config.hidden_size)
    delta = layer.attn_conv.delta(z)
    torch.testing.assert_close(two_tap_conv(z, layer.attn_conv.base_pre, delta), z)


@torch.no_grad()
def test_sampled_drafts_stay_among_the_candidates(tiny_target):
    """At T > 0 the draft distribution is the transform of S over slot t's C candidates, zero elsewhere."""
    torch.manual_seed(1)
    config = DFlash2Config.from_target("dflash2", tiny_target.config, selector_candidates=4)
    drafter = perturbed(DFlash2Drafter(tiny_target.config, tiny_target.model, config=config))
    tokens = torch.randint(3, 90, (14,), generator=torch.Generator().manual_seed(2))
    pool = tiny_target.model.new_pool(8, 8, drafter.num_drafter_layers)
    pool.add_sequence(0)
    out = tiny_target.model(tokens[None, :-1], pool, [0], drafter.target_layers)
    drafter.commit(pool, [0], out.hidden, torch.tensor([13]))
    batch = DraftBatch([0], tokens[-1:], [tokens.tolist()], pool,
                       SamplingBatch.from_params([SamplingParams(temperature=1.0)]), [torch.Generator().manual_seed(3)])
    proposal = drafter.propose(batch, 5)
    support = (proposal.draft_probs[0] > 0).sum(-1)  # (K,)
    assert bool((support <= 4).all()) and bool((support >= 1).all())
    torch.testing.assert_close(proposal.draft_probs[0].sum(-1), torch.ones(5))


def test_selector_loss_inserts_the_gold_token(tiny_target, feats):
    torch.manual_seed(2)
    config = DFlash2Config.from_target("dflash2", tiny_target.config, selector_candidates=2)
    drafter = perturbed(DFlash2Drafter(tiny_target.config, tiny_target.model, config=config)).train()
    batch = make_batch(drafter, tiny_target.model, feats, torch.tensor([12, 20, 30, 41]), 6)
    logits, loss = drafter.training_logits(batch.ctx, batch.prev_tokens, batch.labels, batch.valid)
    top2 = logits.topk(2, -1).indices
    gold_local = (drafter.head.draft_vocab_ids[None, None] == batch.labels[..., None]).float().argmax(-1)
    assert not bool((top2 == gold_local[..., None]).any(-1).all()), "every gold token already a candidate"
    assert torch.isfinite(loss) and float(loss.detach()) > 0
    loss.backward()
    assert drafter.selector.B.weight.grad.abs().sum() > 0 and drafter.selector.query.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("trains_backbone", [True, False])
def test_the_selector_loss_reaches_the_backbone_only_when_asked(tiny_target, feats, trains_backbone):
    config = DFlash2Config.from_target("dflash2", tiny_target.config, selector_trains_backbone=trains_backbone)
    drafter = perturbed(DFlash2Drafter(tiny_target.config, tiny_target.model, config=config)).train()
    batch = make_batch(drafter, tiny_target.model, feats, torch.tensor([12, 20, 30, 41]), 6)
    _, loss = drafter.training_logits(batch.ctx, batch.prev_tokens, batch.labels, batch.valid)
    loss.backward()  # the selector's loss alone: U is detached in it
    backbone = drafter.layers[-1].mlp.down_proj.weight.grad
    assert drafter.selector.query.weight.grad.abs().sum() > 0
    assert (backbone is not None and bool(backbone.abs().sum() > 0)) == trains_backbone
