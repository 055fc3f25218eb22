"""DFly, and what every kind whose slot k depends on the draft before it must satisfy.

Losslessness (greedy == plain, sampled distribution == the target's), Speculators save/load, the
engine's preemption schedule and the describe/kv-table rows of every kind come from the suites
parametrised over the registry (test_generate.py, test_checkpoint.py, test_engine.py,
test_kv_accounting.py). Here: DFly's equations, and for every kind with `sequential_head`
(DFly, DFlash-2, DeLS-Spec) that training's teacher-forced logits are what `propose` drafts from and
that a few training steps run and lower the loss.
"""

from __future__ import annotations

import pytest
import torch

from hspec.drafters import DRAFTERS, create_drafter
from hspec.drafters.base import DraftBatch
from hspec.drafters.dfly import DFlyConfig, DFlyDrafter, dfly_trainable_params
from hspec.models.kv_accounting import known_target
from hspec.models.llama import TargetModel
from hspec.sampling import SamplingBatch, SamplingParams
from hspec.training.trainer import TrainConfig, Trainer, make_batch

SEQUENTIAL_KINDS = [k for k in DRAFTERS.names() if DRAFTERS.get(k).sequential_head]


def randomised(tiny_target, kind: str, seed: int = 0):
    """A drafter of `kind` with every weight perturbed (zero-initialised parts included)."""
    torch.manual_seed(seed)
    drafter = create_drafter(kind, tiny_target.config, target_model=tiny_target.model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return drafter.eval()


# ---- DFly ---------------------------------------------------------------------------------------------


def test_dfly_params_formula_and_paper_sized_target():
    config = known_target("qwen3-8b").config
    with torch.device("meta"):
        drafter = DFlyDrafter(config, TargetModel(config))
    assert drafter.num_trainable_params() == dfly_trainable_params(drafter.config)
    assert drafter.config.markov_rank == 0 and drafter.markov is None
    assert drafter.num_drafter_layers == 5  # one drafter KV layer per drafter layer, as DFlash
    with pytest.raises(ValueError, match="correction_intermediate_size"):
        DFlyConfig.from_target("dfly", config, correction_intermediate_size=-1)
    with pytest.raises(ValueError, match="reuse_target_kv"):
        DFlyConfig.from_target("dfly", config, reuse_target_kv=True)


@torch.no_grad()
def test_dfly_context_is_the_per_layer_fusion(tiny_target, features):
    drafter = randomised(tiny_target, "dfly")
    hidden = features[0].hidden[None, :9].float()  # (1, S, n_sel, H)
    contexts = drafter.layer_contexts(hidden)  # (layers, 1, S, H)
    for i in range(drafter.config.num_layers):
        mix = torch.softmax(drafter.fusion_logits[i], -1)
        expected = drafter.hidden_norm(drafter.fc(hidden.flatten(-2)) + (mix[:, None] * hidden).sum(-2))
        torch.testing.assert_close(contexts[i], expected)
    assert not torch.allclose(contexts[0], contexts[1])  # each layer mixes the tapped layers its own way


@torch.no_grad()
def test_dfly_untrained_correction_is_dflash(tiny_target, features):
    """The correction's down-projection starts at zero: a fresh DFly drafts from the backbone alone."""
    drafter = create_drafter("dfly", tiny_target.config, target_model=tiny_target.model).eval()
    batch = make_batch(drafter, tiny_target.model, features[1], torch.tensor([12, 20]), 5)
    torch.testing.assert_close(drafter.teacher_forced_logits(batch.ctx, batch.prev_tokens),
                               drafter.block_logits(batch.ctx))
    trained = randomised(tiny_target, "dfly")
    batch = make_batch(trained, tiny_target.model, features[1], torch.tensor([12, 20]), 5)
    assert not torch.allclose(trained.teacher_forced_logits(batch.ctx, batch.prev_tokens),
                              trained.block_logits(batch.ctx))


# ---- every kind with a sequential head -----------------------------------------------------------------


def test_the_sequential_kinds_are_registered():
    assert "dfly" in SEQUENTIAL_KINDS


@pytest.mark.parametrize("kind", SEQUENTIAL_KINDS)
@torch.no_grad()
def test_teacher_forced_logits_are_what_propose_drafts_from(tiny_target, features, kind):
    """After a prefill of the same prefix, `propose` drafts the argmax of the training logits
    teacher-forced on its own drafts, and at T > 0 its q_k is the sampling transform of them."""
    if DRAFTERS.get(kind).proposes_tree:
        pytest.skip("a tree kind's teacher-forced logits carry the previous block's state, which a fresh prefill "
                    "lacks; test_specblock.py checks propose_tree against block_states with the same state")
    drafter = randomised(tiny_target, kind, seed=4)
    feats, K = features[1], 5
    tokens = feats.tokens
    for p in (feats.prompt_length, feats.prompt_length + 17):
        pool = tiny_target.model.new_pool(16, 8, drafter.num_drafter_layers)
        pool.add_sequence(0)
        out = tiny_target.model(tokens[None, :p], pool, [0], drafter.target_layers)
        drafter.commit(pool, [0], out.hidden, torch.tensor([p]))
        blocks = make_batch(drafter, tiny_target.model, feats, torch.tensor([p]), K)
        for params in (SamplingParams(), SamplingParams(temperature=0.9, top_k=20)):
            batch = DraftBatch([0], tokens[p:p + 1], [tokens[:p + 1].tolist()], pool,
                               SamplingBatch.from_params([params]), [torch.Generator().manual_seed(p)])
            proposal = drafter.propose(batch, K)
            prev = torch.cat([tokens[p:p + 1], proposal.draft_tokens[0, :-1]])[None]
            logits = drafter.teacher_forced_logits(blocks.ctx, prev)  # (1, K, Vp)
            if params.temperature == 0:
                assert drafter.head.to_target_ids(logits.argmax(-1)).tolist() == proposal.draft_tokens.tolist()
            else:
                q = drafter.head.to_full(SamplingBatch.from_params([params]).probs(logits))
                torch.testing.assert_close(proposal.draft_probs, q, atol=1e-5, rtol=1e-4)
                drafted = proposal.draft_probs[0].gather(-1, proposal.draft_tokens[0, :, None])
                assert bool((drafted > 0).all())
        drafter.release(0)


# DeLS-Spec's 30 steps cost ~25 s here, the other kinds' ~3 s: it runs with `-m slow` (CI runs those too), so
# that the default suite stays under 15 minutes.
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "dels" else k
                                  for k in SEQUENTIAL_KINDS])
def test_a_few_training_steps_lower_the_loss(tiny_target, features, kind):
    torch.manual_seed(0)
    drafter = create_drafter(kind, tiny_target.config, target_model=tiny_target.model)
    config = TrainConfig(steps=30, lr=3e-3, seqs_per_step=4, anchors_per_seq=8, seed=1, warmup_fraction=0.0)
    trainer = Trainer(drafter, tiny_target.model, features.__getitem__, list(range(len(features))), config)
    before = [p.detach().clone() for p in drafter.parameters()]
    first = trainer.compute_gradients(0)[0]
    logs = [trainer.train_step(step) for step in range(config.steps)]
    assert all(torch.isfinite(torch.tensor(log.loss)) for log in logs)
    last = trainer.compute_gradients(0)[0]  # the same step's sequences and anchors as `first`
    assert last < first, (first, last)
    changed = [not torch.equal(a, b) for a, b in zip(before, drafter.parameters())]
    frozen = [not p.requires_grad for p in drafter.parameters()]
    assert all(c or f for c, f in zip(changed, frozen)), "a trainable tensor never moved"
