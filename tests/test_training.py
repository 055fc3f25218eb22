"""The training recipe: loss exactness, anchors and masks, schedule, exact resume, DDP == single process."""

from __future__ import annotations

import math

import pytest
import torch

from hspec.drafters import create_drafter
from hspec.drafters.common import kv_layer_of, select_target_layers
from hspec.metrics import acceptance_stats
from hspec.training.features import compute_features, teacher_summary
from hspec.training.losses import LossWeights, drafter_loss, position_weights, total_variation
from hspec.training.trainer import TrainConfig, Trainer, learning_rate, make_batch, sample_anchors
from hspec.training.vocab import most_frequent_tokens


def test_tv_term_is_exact_half_l1():
    g = torch.Generator().manual_seed(0)
    V, vocab = 10, torch.tensor([1, 3, 4, 8])
    p = torch.softmax(torch.randn(3, V, generator=g), -1)
    q = torch.softmax(torch.randn(3, 4, generator=g), -1)
    q_full = torch.zeros(3, V)
    q_full[:, vocab] = q
    assert torch.allclose(total_variation(q, p[:, vocab]), 0.5 * (q_full - p).abs().sum(-1), atol=1e-7)


def test_the_teacher_is_the_targets_softmax_restricted_to_the_draft_vocabulary(tiny_target):
    tokens = torch.randint(0, tiny_target.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    layers = select_target_layers(tiny_target.config.num_layers)
    feats = compute_features(tiny_target.model, tokens.tolist(), 8, layers, [kv_layer_of(x) for x in layers])
    with pytest.raises(ValueError, match="with_teacher"):
        feats.teacher(tiny_target.model.lm_head_weight(), torch.arange(5))
    feats = feats.with_teacher(tiny_target.model)
    assert feats.with_teacher(tiny_target.model) is feats
    vocab = torch.tensor([0, 7, 9, 30, 31, 90])
    positions = torch.tensor([[3, 4, 5], [4, 5, 6], [20, 21, 39]])
    teacher = feats.teacher(tiny_target.model.lm_head_weight()[vocab], positions)
    full = torch.softmax(tiny_target.model.lm_head(feats.final_hidden).float(), -1)  # (S, V)
    torch.testing.assert_close(teacher.on_vocab, full[positions][..., vocab], rtol=1e-5, atol=1e-7)
    assert torch.equal(teacher.argmax, full.argmax(-1)[positions])
    # Its summary does not depend on how many positions one pass takes.
    lse, argmax = teacher_summary(tiny_target.model, feats.final_hidden)
    for rows in (1, 7):
        one_by_one = [teacher_summary(tiny_target.model, h) for h in feats.final_hidden.split(rows)]
        torch.testing.assert_close(torch.cat([x for x, _ in one_by_one]), lse)
        assert torch.equal(torch.cat([x for _, x in one_by_one]), argmax)


def test_loss_weights_and_mixture():
    K, V = 3, 5
    vocab = torch.arange(V)
    logits = torch.randn(2, K, V)
    p = torch.softmax(torch.randn(2, K, V), -1)
    labels = torch.randint(0, V, (2, K))
    parts = drafter_loss(logits, p[..., vocab], labels, vocab, weights=LossWeights(ce=0.1, tv=0.9, gamma=4.0))
    w = torch.tensor([1.0, math.exp(-1 / 4), math.exp(-2 / 4)])
    assert torch.allclose(position_weights(3), w)
    q = torch.softmax(logits, -1)
    tv = 0.5 * (q - p).abs().sum(-1).mean(0)
    ce = -torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1).mean(0)
    expected = (w * (0.1 * ce + 0.9 * tv)).sum() / w.sum()
    assert torch.allclose(parts.loss, expected, atol=1e-6)


def test_schedule_warmup_then_half_cosine():
    c = TrainConfig(steps=200, lr=6e-4, warmup_fraction=0.01)
    assert learning_rate(0, c) == pytest.approx(3e-4) and learning_rate(1, c) == pytest.approx(6e-4)
    assert learning_rate(101, c) == pytest.approx(3e-4, rel=1e-2)
    assert learning_rate(199, c) < 1e-6 * 6e-4 * 1e4


def test_vocab_pruning_keeps_most_frequent():
    ids = most_frequent_tokens([[5, 5, 5, 2, 2, 9], [9, 9, 9, 9]], vocab_size=12, keep=2)
    assert ids.tolist() == [5, 9]


def _drafter(tiny_target, kind="hspec", seed=0):
    torch.manual_seed(seed)
    return create_drafter(kind, tiny_target.config, target_model=tiny_target.model)


def test_anchor_masks_never_see_own_future_or_other_blocks(tiny_target, features):
    drafter = _drafter(tiny_target)
    feats = features[0]
    anchors = sample_anchors(feats, 8, torch.Generator().manual_seed(1))
    assert bool((anchors >= feats.prompt_length).all()) and bool((anchors <= len(feats.tokens) - 2).all())
    batch = make_batch(drafter, tiny_target.model, feats, anchors, 7)
    key_pos = torch.arange(len(feats.tokens))
    assert torch.equal(batch.ctx.context_mask, key_pos[None] < anchors[:, None])
    # Changing the context at or after a block's anchor must not change that block's logits.
    drafter.eval()
    with torch.no_grad():
        base = drafter.teacher_forced_logits(batch.ctx, batch.prev_tokens)
        kv = [(k.clone(), v.clone()) for k, v in batch.ctx.context_kv]
        first = int(anchors[0])
        for k, v in kv:
            k[:, first:] += 5.0
            v[:, first:] -= 5.0
        changed = type(batch.ctx)(batch.ctx.block_tokens, batch.ctx.positions, batch.ctx.last_hidden, kv,
                                  batch.ctx.context_mask)
        after = drafter.teacher_forced_logits(changed, batch.prev_tokens)
    assert torch.allclose(after[0], base[0], atol=1e-5)
    # Rows are independent: dropping every other block leaves the rest unchanged.
    with torch.no_grad():
        half = make_batch(drafter, tiny_target.model, feats, anchors[::2], 7)
        assert torch.allclose(drafter.teacher_forced_logits(half.ctx, half.prev_tokens), base[::2], atol=1e-5)


def _trainer(tiny_target, features, drafter, steps, rank=0, world=1, seqs=2):
    config = TrainConfig(steps=steps, seqs_per_step=seqs, anchors_per_seq=6, seed=3)
    return Trainer(drafter, tiny_target.model, features.__getitem__, list(range(len(features))), config, rank, world)


def test_resume_is_exact(tiny_target, features, tmp_path):
    from hspec.training.checkpoint import load_training_state, save_training_state

    straight = _drafter(tiny_target, seed=1)
    t = _trainer(tiny_target, features, straight, steps=6)
    for step in range(6):
        t.train_step(step)
    interrupted = _drafter(tiny_target, seed=1)
    t1 = _trainer(tiny_target, features, interrupted, steps=6)
    for step in range(3):
        t1.train_step(step)
    save_training_state(tmp_path / "state", interrupted, t1.optimizer, 3, {})
    resumed = _drafter(tiny_target, seed=99)  # different init: everything must come from the checkpoint
    t2 = _trainer(tiny_target, features, resumed, steps=6)
    start, _ = load_training_state(tmp_path / "state", resumed, t2.optimizer)
    for step in range(start, 6):
        t2.train_step(step)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_target_stays_frozen_and_gets_no_gradient(tiny_dirs, features):
    """Loaded targets are frozen; a target handed over trainable is frozen by the trainer, so the tied
    LM head that computes the target's distribution gets no full-vocabulary gradient."""
    from conftest import load_tiny

    target = load_tiny(tiny_dirs["llama"])
    assert not any(p.requires_grad for p in target.model.parameters())
    target.model.requires_grad_(True)
    drafter = _drafter(target)
    trainer = Trainer(drafter, target.model, features.__getitem__, list(range(len(features))),
                      TrainConfig(steps=2, seqs_per_step=2, anchors_per_seq=6, seed=3))
    trainer.train_step(0)
    assert all(p.grad is None and not p.requires_grad for p in target.model.parameters())
    assert all(p.grad is not None for p in trainer.params)


def _gradient_trainer(tiny_dir, seqs_per_step: int, rank: int = 0, world: int = 1) -> Trainer:
    """The same 4 random sequences and the same initial drafter in every process; gradients of step 0."""
    from conftest import load_tiny, random_sequence_features

    target = load_tiny(tiny_dir)
    feats = random_sequence_features(target)
    torch.manual_seed(0)
    drafter = create_drafter("hspec", target.config, target_model=target.model)
    trainer = Trainer(drafter, target.model, feats.__getitem__, [0, 1, 2, 3],
                      TrainConfig(steps=2, seqs_per_step=seqs_per_step, anchors_per_seq=6, seed=3), rank, world)
    trainer.compute_gradients(0)
    return trainer


def _ddp_worker(rank, world, init_method, tiny_dir, result_file):
    import os

    import torch.distributed as dist

    from hspec.training.trainer import all_reduce_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    trainer = _gradient_trainer(tiny_dir, seqs_per_step=1, rank=rank, world=world)
    all_reduce_gradients(trainer.params)
    if rank == 0:
        torch.save([p.grad.clone() for p in trainer.params], result_file)
    dist.barrier()
    # Leave without tearing the group down: rank 0 hosts the TCP store, and a rank still in
    # destroy_process_group when rank 0 exits first aborts in gloo's C++ threads (seen in CI).
    os._exit(0)


def test_two_process_gloo_matches_single_process(tiny_dirs, tmp_path):
    """Each of 2 gloo processes takes one of the step's 2 sequences; averaged gradients equal one process's."""
    import socket

    import torch.multiprocessing as mp

    # A TCP store on a free loopback port: the file store's teardown aborted a rank now and then under load.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, f"tcp://127.0.0.1:{port}", tiny_dirs["llama"], str(tmp_path / "g.pt")), nprocs=2)
    ddp_grads = torch.load(tmp_path / "g.pt")
    trainer = _gradient_trainer(tiny_dirs["llama"], seqs_per_step=2)
    for a, p in zip(ddp_grads, trainer.params):
        b = p.grad if p.grad is not None else torch.zeros_like(p)
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("kind", ["hspec", "dflash", "peagle"])
@torch.no_grad()
def test_training_blocks_see_what_inference_sees(tiny_target, features, kind):
    """The block a training anchor builds from cached features drafts exactly what `propose` drafts
    after a prefill of the same prefix (same last hidden state, context K/V, positions, Markov path)."""
    from hspec.drafters.base import DraftBatch
    from hspec.sampling import SamplingBatch, SamplingParams

    drafter = _drafter(tiny_target, kind, seed=4).eval()
    feats, K = features[1], 5
    tokens = feats.tokens
    for p in (feats.prompt_length, feats.prompt_length + 17):
        pool = tiny_target.model.new_pool(16, 8, drafter.num_drafter_layers)
        pool.add_sequence(0)
        out = tiny_target.model(tokens[None, :p], pool, [0], drafter.target_layers)
        drafter.commit(pool, [0], out.hidden, torch.tensor([p]))
        batch = DraftBatch([0], tokens[p:p + 1], [tokens[:p + 1].tolist()], pool,
                           SamplingBatch.from_params([SamplingParams()]), [torch.Generator()])
        proposal = drafter.propose(batch, K)
        blocks = make_batch(drafter, tiny_target.model, feats, torch.tensor([p]), K)
        prev = torch.cat([tokens[p:p + 1], proposal.draft_tokens[0, :-1]])[None]
        logits = drafter.teacher_forced_logits(blocks.ctx, prev)
        assert drafter.head.to_target_ids(logits.argmax(-1)).tolist() == proposal.draft_tokens.tolist()
        drafter.release(0)


@torch.no_grad()
def test_validation_in_decode_order_counts_the_steps_greedy_decoding_takes(tiny_target):
    """On a greedy response of the target, the decode-order validation visits the same anchors and
    accepts the same counts as speculative decoding from the same prompt, step for step, up to the
    last block that fits in the response."""
    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.drafters import create_drafter as create
    from hspec.sampling import SamplingParams

    model, V, K = tiny_target.model, tiny_target.config.vocab_size, 7
    prompt = torch.randint(3, V, (12,), generator=torch.Generator().manual_seed(6)).tolist()
    plain = SpeculativeDecoder(model, create("none", tiny_target.config), K, eos_token_ids=())
    response = plain.generate([prompt], SamplingParams(), 60).sequences[0].token_ids

    # A drafter that knows the response's bigrams through its Markov head: its drafts follow them, so
    # some blocks are accepted whole, some in part and some not at all.
    drafter = _drafter(tiny_target, seed=2).eval()
    successor = {a: b for a, b in reversed(list(zip(response, response[1:])))}  # first occurrence wins
    drafter.markov.W1.weight.zero_()
    drafter.markov.W1.weight[:, :V] = torch.eye(V)
    drafter.markov.W2.zero_()
    for a, b in successor.items():
        drafter.markov.W2[a, b] = 1e4

    live = SpeculativeDecoder(model, drafter, K, eos_token_ids=()).generate([prompt], SamplingParams(), 60)
    assert live.sequences[0].token_ids == response
    steps, last_anchor = [], len(prompt) + len(response) - 1 - K
    anchor = len(prompt)
    for accepted in live.sequences[0].num_accepted:
        if anchor > last_anchor:
            break
        steps.append(accepted)
        anchor += accepted + 1
    assert 0 < sum(steps) < K * len(steps) and len(set(steps)) > 2  # a mix, or the check is weak

    layers = select_target_layers(tiny_target.config.num_layers)
    feats = compute_features(model, prompt + response, len(prompt), layers, [kv_layer_of(x) for x in layers])
    trainer = Trainer(drafter, model, [feats].__getitem__, [0], TrainConfig(steps=1))
    in_order = trainer.validate_in_decode_order([0], rows_per_forward=5)
    assert in_order.accepted_count_histogram == acceptance_stats(steps, K).accepted_count_histogram
