"""A training step's blocks as one batch (`make_step_batch`): the same rows, logits, loss and gradients as
one batch per sequence with every row reading its own copy of its sequence's context (the trainer before)."""

from __future__ import annotations

import pytest
import torch

from hspec.drafters import DRAFTERS, create_drafter
from hspec.drafters.common import BlockContext, NeuralDrafter
from hspec.training.losses import drafter_loss
from hspec.training.trainer import TrainConfig, Trainer, make_batch, make_step_batch, sample_anchors

NEURAL_KINDS = [k for k in DRAFTERS.names() if issubclass(DRAFTERS.get(k), NeuralDrafter)]


def _drafter(tiny_target, kind: str = "hspec", seed: int = 0) -> NeuralDrafter:
    torch.manual_seed(seed)
    drafter = create_drafter(kind, tiny_target.config, target_model=tiny_target.model)
    with torch.no_grad():  # W2 starts at zero: give the Markov head something to add
        if drafter.markov is not None:
            drafter.markov.W2.normal_(std=0.02)
    return drafter


def _per_row(ctx: BlockContext) -> BlockContext:
    """`ctx` with every row reading its own (expanded) copy of its group's context (G = N)."""
    n = ctx.block_tokens.shape[0]
    kv = [(k.repeat_interleave(n // k.shape[0], 0), v.repeat_interleave(n // v.shape[0], 0))
          for k, v in ctx.context_kv]
    return BlockContext(ctx.block_tokens, ctx.positions, ctx.last_hidden, kv, ctx.context_mask, ctx.history)


@pytest.mark.parametrize("kind", NEURAL_KINDS)
@torch.no_grad()
def test_step_batch_rows_are_the_rows_of_each_sequence(tiny_target, features, kind):
    """Sequences of 40 and 33 tokens, K and 3 anchors: the second is padded (rows and keys), and every real
    row equals the row of that sequence's own batch read per row; padding rows have no valid label."""
    drafter = _drafter(tiny_target, kind).eval()
    K = drafter.config.max_draft_len
    feats = [features[0], features[2]]
    anchors = [sample_anchors(feats[0], K, torch.Generator().manual_seed(1)),
               sample_anchors(feats[1], 3, torch.Generator().manual_seed(2))]
    step = make_step_batch(drafter, tiny_target.model, feats, anchors, K)
    assert step.groups == 2 and step.ctx.block_tokens.shape == (2 * K, K)
    assert all(k.shape[0] == 2 for k, _ in step.ctx.context_kv)  # one context per sequence, not per row
    logits = drafter.teacher_forced_logits(step.ctx, step.prev_tokens)
    for g, (f, a) in enumerate(zip(feats, anchors)):
        rows = slice(g * K, g * K + a.numel())
        alone = make_batch(drafter, tiny_target.model, f, a, K)
        for name in ("prev_tokens", "labels", "valid"):
            assert torch.equal(getattr(step, name)[rows], getattr(alone, name)), name
        assert torch.equal(step.teacher.on_vocab[rows], alone.teacher.on_vocab)
        reference = drafter.teacher_forced_logits(_per_row(alone.ctx), alone.prev_tokens)
        torch.testing.assert_close(logits[rows], reference, atol=1e-5, rtol=1e-4)
    assert not step.valid[K + 3:].any()  # the second sequence's padding rows


def test_grouped_loss_is_the_mean_of_the_sequences_losses():
    g = torch.Generator().manual_seed(0)
    n, K, vp = 6, 4, 10
    logits = torch.randn(2 * n, K, vp, generator=g)
    teacher = torch.softmax(torch.randn(2 * n, K, vp + 3, generator=g), -1)[..., :vp]
    labels = torch.randint(0, vp + 3, (2 * n, K), generator=g)
    valid = torch.rand(2 * n, K, generator=g) < 0.8
    valid[n:] = False  # a sequence without a valid label adds 0, as a skipped one did
    vocab = torch.arange(vp)
    both = drafter_loss(logits, teacher, labels, vocab, valid, groups=2)
    first = drafter_loss(logits[:n], teacher[:n], labels[:n], vocab, valid[:n])
    torch.testing.assert_close(both.loss, first.loss / 2)
    torch.testing.assert_close(both.tv, first.tv / 2)
    with pytest.raises(ValueError, match="divide"):
        drafter_loss(logits, teacher, labels, vocab, valid, groups=5)


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_step_gradients_equal_one_batch_per_sequence(tiny_target, features, precision):
    """The trainer's one-batch step gives the loss and gradients of the per-sequence step it replaced: each
    sequence's blocks forward on their own over per-row contexts, its loss / G, one backward."""
    from hspec.training.precision import precision_context
    from hspec.training.trainer import step_generator

    config = TrainConfig(steps=4, seqs_per_step=3, anchors_per_seq=9, seed=5, precision=precision)
    trainer = Trainer(_drafter(tiny_target), tiny_target.model, features.__getitem__, list(range(4)), config)
    loss, _, _ = trainer.compute_gradients(1)
    packed = [p.grad.clone() for p in trainer.params]

    reference = Trainer(_drafter(tiny_target), tiny_target.model, features.__getitem__, list(range(4)), config)
    drafter, pairs = reference.drafter, reference.sequences_for_step(1)
    total = torch.zeros(())
    for slot, seq in pairs:
        feats = reference.load(seq)
        batch = make_batch(drafter, tiny_target.model, feats, sample_anchors(feats, 9, step_generator(5, 1, slot)),
                           drafter.config.max_draft_len, head_rows=reference.head_rows)
        with precision_context(precision, "cpu"):
            backbone = drafter.block_logits(_per_row(batch.ctx))
            correction = drafter.markov_logits(batch.prev_tokens)
        parts = drafter_loss(backbone.float() + correction.float(), batch.teacher.on_vocab, batch.labels,
                             drafter.head.draft_vocab_ids, batch.valid)
        total = total + parts.loss / len(pairs)
    total.backward()
    assert loss == pytest.approx(float(total.detach()), rel=1e-5 if precision == "fp32" else 1e-2)
    tolerance = {"fp32": 1e-5, "bf16-autocast": 3e-2}[precision]
    for a, p in zip(packed, reference.params):
        torch.testing.assert_close(a, p.grad, atol=tolerance * float(p.grad.abs().max()) + 1e-7, rtol=tolerance)


@pytest.mark.slow
def test_a_compiled_step_trains_as_the_eager_one(tiny_target, features):
    """`TrainConfig.compile`: the step's forward and loss through torch.compile, over steps whose context length
    changes (one graph, the length dynamic), give the eager step's losses to rounding."""
    losses = {}
    for compiled in (False, True):
        config = TrainConfig(steps=3, seqs_per_step=2, anchors_per_seq=6, seed=3, compile=compiled)
        trainer = Trainer(_drafter(tiny_target), tiny_target.model, features.__getitem__, list(range(4)), config)
        losses[compiled] = [trainer.train_step(step).loss for step in range(3)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
