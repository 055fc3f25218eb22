"""DeLS-Spec: the fusion, the local head's history, the frozen DFlash part and its recipe.

Losslessness, save/load, the engine schedule and describe/kv-table rows come from the suites
parametrised over the registry; test_dfly.py checks that `propose` draws from the teacher-forced
logits (greedy and sampled) and that a few training steps lower the loss.
"""

from __future__ import annotations

import pytest
import torch

from hspec.drafters import create_drafter
from hspec.drafters.common import kv_layer_of, select_target_layers
from hspec.drafters.dels import DeLSConfig, DeLSDrafter, dels_trainable_params
from hspec.models.kv_accounting import known_target
from hspec.models.llama import TargetModel
from hspec.training.features import compute_features
from hspec.training.trainer import TrainConfig, Trainer, make_batch


@pytest.fixture(scope="module")
def features(tiny_target):
    g = torch.Generator().manual_seed(3)
    layers = select_target_layers(tiny_target.config.num_layers)
    return [compute_features(tiny_target.model, torch.randint(3, 96, (n,), generator=g).tolist(), 10, layers,
                             [kv_layer_of(x) for x in layers]) for n in (45, 38)]


def small(tiny_target, **overrides) -> DeLSDrafter:
    config = DeLSConfig.from_target("dels", tiny_target.config, local_hidden=32, local_rank=8, **overrides)
    return DeLSDrafter(tiny_target.config, tiny_target.model, config=config)


def test_params_formula_and_only_the_local_head_trains():
    config = known_target("qwen3-8b").config
    with torch.device("meta"):
        drafter = DeLSDrafter(config, TargetModel(config))
    assert drafter.num_trainable_params() == dels_trainable_params(drafter.config)
    assert {n.split(".")[0] for n, p in drafter.named_parameters() if p.requires_grad} == {"local"}
    with pytest.raises(ValueError, match="local_window"):
        DeLSConfig.from_target("dels", config, local_window=-1)
    with pytest.raises(ValueError, match="fusion_alpha"):
        DeLSConfig.from_target("dels", config, fusion_alpha=-0.1)


@torch.no_grad()
def test_fusion_is_dflash_plus_alpha_local_minus_beta_prior(tiny_target, features):
    torch.manual_seed(0)
    dflash = create_drafter("dflash", tiny_target.config, target_model=tiny_target.model).eval()
    drafter = small(tiny_target).eval()
    drafter.load_dflash_weights(dflash.state_dict())
    batch = make_batch(drafter, tiny_target.model, features[0], torch.tensor([10, 22, 40]), 5)
    u = dflash.block_logits(batch.ctx)
    # Untrained: l_local = 0 and a uniform prior, so DeLS drafts exactly what its DFlash part drafts.
    torch.testing.assert_close(drafter.teacher_forced_logits(batch.ctx, batch.prev_tokens), u)
    drafter.local.up.normal_()
    counts = torch.randint(0, 50, (tiny_target.config.vocab_size,), generator=torch.Generator().manual_seed(1))
    drafter.set_log_prior(counts)
    prior = (counts.double() + 1).log() - (counts.double() + 1).sum().log()  # draft vocabulary = all 96 ids
    torch.testing.assert_close(drafter.log_prior, prior.float())
    local = drafter.local_logits(batch.ctx.history, batch.prev_tokens)
    torch.testing.assert_close(drafter.teacher_forced_logits(batch.ctx, batch.prev_tokens),
                               u + 0.3 * local - 0.3 * prior.float())
    with pytest.raises(ValueError, match="not a dflash drafter"):
        drafter.load_dflash_weights({"nope": torch.zeros(1)})


def test_history_is_the_window_before_the_anchor(tiny_target, features):
    drafter = small(tiny_target, local_window=6)
    tokens = features[0].tokens
    batch = make_batch(drafter, tiny_target.model, features[0], torch.tensor([3, 20]), 4)
    assert batch.ctx.history.tolist() == [[-1, -1, -1] + tokens[:3].tolist(), tokens[14:20].tolist()]
    history = drafter.history_of([tokens[:4].tolist(), tokens[:21].tolist()], torch.device("cpu"))
    assert torch.equal(history, batch.ctx.history)  # inference reads the same window (histories end with x0)
    # Tokens before the window do not change the local head; tokens inside it do.
    prev = batch.prev_tokens
    with torch.no_grad():
        drafter.local.up.normal_()
        base = drafter.local_logits(batch.ctx.history, prev)
        changed = batch.ctx.history.clone()
        changed[1, 0] = (changed[1, 0] + 1) % 96
        assert not torch.allclose(drafter.local_logits(changed, prev)[1], base[1])


@torch.no_grad()
def test_int8_local_head_runs_the_gru_equations():
    """`LocalHead.store_int8`: drafting runs its own recurrence over int8 gate matrices. With weights int8
    holds exactly (integers times a power-of-two scale per row) it gives nn.GRU's outputs and state, in the
    gates' order r, z, n; with any weights it stays close; a head that trains keeps nn.GRU."""
    from hspec.drafters.dels.model import LocalHead

    g = torch.Generator().manual_seed(0)

    def exact(rows: int, cols: int) -> torch.Tensor:  # (rows, cols), each row k / 127 * 2^-e with some |k| = 127
        levels = torch.randint(-127, 128, (rows, cols), generator=g).float()
        levels[:, 0] = 127.0
        return levels * 2.0 ** -torch.randint(5, 9, (rows, 1), generator=g).float()

    head = LocalHead(32, 48, 16, 64).requires_grad_(False)
    head.gru.weight_ih_l0.copy_(exact(144, 32))
    head.gru.weight_hh_l0.copy_(exact(144, 48))
    head.up.copy_(exact(64, 16).t())
    head.gru.bias_ih_l0.normal_(generator=g)
    head.gru.bias_hh_l0.normal_(generator=g)
    x, state = torch.randn(3, 5, 32, generator=g), torch.randn(1, 3, 48, generator=g)
    expected, expected_state = head(x, state)
    head.store_int8(torch.float32, "torch")
    assert head._int8["hh"].weight.dtype == torch.int8
    got, got_state = head(x, state)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_state, expected_state, atol=1e-5, rtol=1e-5)
    head.gru.weight_hh_l0.add_(torch.randn(144, 48, generator=g) * 1e-3)  # off the int8 grid: close, not equal
    head.gru.weight_ih_l0.add_(torch.randn(144, 32, generator=g) * 1e-3)
    floating, _ = head.gru(x, state)
    head.store_int8(torch.float32, "torch")
    rounded, _ = head._recurrence_int8(x, state)
    assert not torch.equal(rounded, floating)
    torch.testing.assert_close(rounded, floating, atol=0.05, rtol=0.05)
    head.requires_grad_(True)  # training: nn.GRU, whatever is stored
    with torch.enable_grad():
        trained, _ = head(x, state)
    torch.testing.assert_close(trained, head.gru(x, state)[0] @ head.down.weight.t() @ head.up)


def test_drafting_under_a_bf16_target_stores_the_local_head_in_int8(tiny_target):
    """`runtime.prepare_for_inference` reaches the local head through `NeuralDrafter.store_int8` (the
    losslessness of int8 drafting is test_generate.py's, for every kind)."""
    from hspec.runtime import prepare_for_inference

    config = DeLSConfig.from_target("dels", tiny_target.config, local_hidden=32, local_rank=16)
    drafter = DeLSDrafter(tiny_target.config, tiny_target.model, config=config, dtype=torch.bfloat16)
    drafter = prepare_for_inference(drafter, "bfloat16", "cpu")
    assert set(drafter.local._int8) == {"ih", "hh", "up"}  # every width a multiple of the kernel's 16
    assert drafter.local._int8["up"].scale.dtype == torch.bfloat16


def test_training_leaves_the_dflash_part_unchanged(tiny_target, features):
    torch.manual_seed(1)
    drafter = small(tiny_target)
    frozen = {n: p.detach().clone() for n, p in drafter.named_parameters() if not n.startswith("local.")}
    config = TrainConfig(steps=4, lr=1e-2, seqs_per_step=2, anchors_per_seq=4, seed=0)
    trainer = Trainer(drafter, tiny_target.model, features.__getitem__, [0, 1], config)
    for step in range(config.steps):
        trainer.train_step(step)
    assert all(torch.equal(p, frozen[n]) for n, p in drafter.named_parameters() if n in frozen)
    assert drafter.local.up.abs().sum() > 0  # the local head did train


def test_hspec_train_runs_dels_over_a_trained_dflash(tmp_path, tiny_target):
    """`hspec train --drafter dels --init-from <dflash drafter>`: the DFlash weights and vocabulary are
    kept (frozen), the local head trains, l_prior comes from the training tokens, and it saves and loads."""
    from hspec.drafters.checkpoint import load_drafter
    from hspec.training import run as train_run
    from hspec.training.store import FeatureStore

    g = torch.Generator().manual_seed(3)
    records = [{"id": f"seq/{i}", "prompt_ids": torch.randint(3, 96, (8,), generator=g).tolist(),
                "response_ids": torch.randint(3, 48, (30,), generator=g).tolist()} for i in range(6)]
    layers = select_target_layers(tiny_target.config.num_layers)
    FeatureStore.build(tmp_path / "features", tiny_target.model, "tiny", records, layers,
                       [kv_layer_of(x) for x in layers])
    recipe = TrainConfig(steps=2, seqs_per_step=2, anchors_per_seq=2)
    dflash_dir = train_run.train("dflash", "tiny", [tmp_path / "features"], tmp_path / "dflash", recipe,
                                 val_every=2, draft_vocab_size=40, target=tiny_target)
    dels_dir = train_run.train("dels", "tiny", [tmp_path / "features"], tmp_path / "dels", recipe, val_every=2,
                               init_from=dflash_dir, target=tiny_target)
    dflash, dels = load_drafter(dflash_dir, tiny_target.model), load_drafter(dels_dir, tiny_target.model)
    assert dels.kind == "dels" and torch.equal(dels.head.draft_vocab_ids, dflash.head.draft_vocab_ids)
    for name, tensor in dflash.state_dict().items():
        assert torch.equal(dels.state_dict()[name], tensor), name
    assert dels.local.up.abs().sum() > 0
    assert dels.log_prior.std() > 0  # response tokens are < 48: the prior is far from uniform
