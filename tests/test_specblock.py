"""SpecBlock: the tree's shape, what `propose_tree` draws, the state carried from block to block (the
same in training as in decoding), the valid-prefix mask, losslessness with trees that branch, and what
the serving engine needs (positions reserved for a tree, the state kept across a preemption).

The registry-wide suites cover the rest (test_generate.py: greedy == plain in fp32 and bf16, the
sampled distribution, batch independence; test_checkpoint.py: save/load; test_kv_accounting.py and
test_bench_serve.py: describe/kv-table rows; test_dfly.py: a few training steps lower the loss;
test_engine.py: the serving engine with preemption against the single-request loop).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hspec.decoding.generate import SpeculativeDecoder
from hspec.decoding.step import DecodeStages
from hspec.drafters import create_drafter
from hspec.drafters.base import DraftBatch
from hspec.drafters.common import kv_layer_of, select_target_layers
from hspec.drafters.sequential import inference_context
from hspec.drafters.specblock import SpecBlockConfig, SpecBlockDrafter, specblock_trainable_params, tree_branching
from hspec.drafters.specblock.tree_shape import cost_aware_budgets, tree_expected_emitted, tree_nodes
from hspec.drafters.step_cost import StepCost
from hspec.models.kv_accounting import known_target
from hspec.models.llama import TargetModel
from hspec.sampling import SamplingBatch, SamplingParams
from hspec.serving.engine import Engine
from hspec.training.features import compute_features
from hspec.training.trainer import make_batch


@pytest.fixture(scope="module")
def features(tiny_target):
    g = torch.Generator().manual_seed(0)
    layers = select_target_layers(tiny_target.config.num_layers)
    tokens = torch.randint(3, tiny_target.config.vocab_size, (60,), generator=g).tolist()
    return compute_features(tiny_target.model, tokens, 10, layers, [kv_layer_of(x) for x in layers])


def randomised(target, seed: int = 0, **overrides) -> SpecBlockDrafter:
    """A specblock drafter with every weight perturbed (the zero-initialised shift included)."""
    torch.manual_seed(seed)
    config = SpecBlockConfig.from_target("specblock", target.config, **overrides)
    drafter = create_drafter("specblock", target.config, target_model=target.model, config=config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        drafter.rank_head.weight.mul_(30.0)  # a confident rank head: branching varies by row and depth
    return drafter.eval()


def recording_tree_sizes(drafter: SpecBlockDrafter) -> list[list[int]]:
    """From now on, each `propose_tree` of `drafter` appends its rows' node counts to the returned list."""
    sizes: list[list[int]] = []
    propose_tree = drafter.propose_tree

    def recording(batch, k):
        tree = propose_tree(batch, k)
        sizes.append(tree.num_nodes.tolist())
        return tree

    drafter.propose_tree = recording  # type: ignore[method-assign]
    return sizes


def prefilled(target, drafter, tokens: list[int], seq_id: int = 0):
    pool = target.model.new_pool(16, 8, drafter.num_drafter_layers)
    pool.add_sequence(seq_id)
    out = target.model(torch.tensor([tokens]), pool, [seq_id], drafter.target_layers)
    drafter.commit(pool, [seq_id], out.hidden, torch.tensor([len(tokens)]))
    return pool


# ---- configuration -----------------------------------------------------------------------------------


def test_params_formula_and_bad_settings():
    config = known_target("qwen3-8b").config
    with torch.device("meta"):
        drafter = SpecBlockDrafter(config, TargetModel(config))
    assert drafter.num_trainable_params() == specblock_trainable_params(drafter.config)
    assert drafter.proposes_tree and drafter.draft_positions(7) == 16 and drafter.draft_positions(20) == 20
    for field, value in (("max_branch", 0), ("node_budget", 0), ("rank_coverage", 0.0), ("markov_rank", 8),
                         ("reuse_target_kv", True), ("rank_loss_weight", -1.0), ("tree_cost_per_node", -0.1)):
        with pytest.raises(ValueError, match=field):
            SpecBlockConfig.from_target("specblock", config, **{field: value})


def test_tree_branching_coverage_and_budget():
    # rank distributions over b_max = 3 (+ "beyond"): coverage 0.8 needs b = 1, 2, 3, and 3 (never reached)
    probs = torch.tensor([[[0.9, 0.05, 0.05, 0.0], [0.5, 0.35, 0.1, 0.05], [0.3, 0.3, 0.3, 0.1],
                           [0.1, 0.1, 0.1, 0.7]]])
    assert tree_branching(probs, 0.8, 100).tolist() == [[1, 2, 3, 3]]
    # budget 8: 1 + 2 = 3 nodes, then 2 leaves x 3 would be 9 > 8, so b = (8 - 3) // 2 = 2, then nothing fits
    assert tree_branching(probs, 0.8, 8).tolist() == [[1, 2, 2, 0]]
    assert tree_branching(probs, 0.8, 1).tolist() == [[1, 0, 0, 0]]
    assert tree_branching(probs.expand(2, -1, -1), 0.8, [100, 8]).tolist() == [[1, 2, 3, 3], [1, 2, 2, 0]]
    with pytest.raises(ValueError, match="node_budget has 1 entries for 2 rows"):
        tree_branching(probs.expand(2, -1, -1), 0.8, [8])


def test_the_cost_aware_budget_maximises_expected_tokens_per_cost():
    """E[emitted] = 1 + sum_k prod_{j<=k} c_j(b_j); each row takes the smallest budget of the best ratio."""
    probs = torch.tensor([[[0.9, 0.05, 0.05, 0.0], [0.5, 0.35, 0.1, 0.05], [0.3, 0.3, 0.3, 0.1],
                           [0.1, 0.1, 0.1, 0.7]]])  # wanted b = 1, 2, 3, 3 (test above)
    cover = probs.cumsum(-1)[0, :, :3]
    assert tree_nodes([1, 2, 2, 0]) == 7 and tree_nodes([1, 0, 2]) == 1
    assert tree_expected_emitted([1, 2, 0, 0], cover) == pytest.approx(1 + 0.9 + 0.9 * 0.85)
    free = StepCost(0.0, 0.0, 0.0)  # free nodes: the whole wanted tree (1 + 2 + 6 + 18 = 27 nodes)
    assert cost_aware_budgets(probs, 0.8, 100, [0], free) == [27]
    assert cost_aware_budgets(probs, 0.8, 8, [0], free) == [7]  # the budget-8 tree has 7 nodes: ties go down
    dear = StepCost(0.25, 1.0, 0.0)  # a node costs a decode: one node, 1.9 tokens for 2.25
    assert cost_aware_budgets(probs, 0.8, 16, [0], dear) == [1]
    # By hand at 0.05 a node (+0.001 a key): budgets 1, 2, 3, 5, 7, 9 give trees of as many nodes (b = 1;
    # 1, 1; 1, 2; 1, 2, 1; 1, 2, 2; 1, 2, 3) and E = 1.9, 2.35, 2.665, 2.89, 3.12, 3.35. At S = 0 the ratio
    # grows with the tree (1.46, 1.74, 1.90, 1.93, 1.95, 1.97: 9 wins); at S = 200 a node costs 0.25 and the
    # ratios are 1.27, 1.34, 1.33, 1.16, 1.04, 0.96: the 2-node chain wins.
    priced = StepCost(0.25, 0.05, 0.001)
    assert cost_aware_budgets(probs.expand(2, -1, -1), 0.8, 9, [0, 200], priced) == [9, 2]
    with pytest.raises(ValueError, match="keys has 1 entries for 2 rows"):
        cost_aware_budgets(probs.expand(2, -1, -1), 0.8, 9, [0], priced)


def test_the_default_tree_costs_are_the_committed_measurements_of_this_cpu():
    """SpecBlockConfig's tree_cost_* defaults (its comment says whence): the per-node cost of a 17-token tree
    verify, (decodes - 1) / 16 at each context of results/tree_verify/, fitted by a line in the keys; and
    SpecBlock's draft over an 8-token verify (results/draft_cost_kinds/) times that verify in decodes."""
    results = Path(__file__).resolve().parents[1] / "results"
    rows = json.loads((results / "tree_verify" / "tree_verify.json").read_text())["rows"]
    keys = np.array([row["S"] for row in rows], dtype=float)
    ms = [row["median_ms"] for row in rows]
    per_node = np.array([(m["tree verify (17 tokens), shared keys"] / m["decode (1 token)"] - 1) / 16 for m in ms])
    slope, intercept = np.polyfit(keys, per_node, 1)
    config = SpecBlockConfig.from_target("specblock", known_target("qwen3-8b").config)
    assert config.tree_cost_per_node == pytest.approx(intercept, rel=0.05)  # rounded to one or two digits
    assert config.tree_cost_per_node_key == pytest.approx(slope, rel=0.05)
    draft_cost = results / "draft_cost_kinds" / "draft_cost_cpu_vp8192_bfloat16.json"
    at_256 = json.loads(draft_cost.read_text())["results"][0]
    chain = ms[0]["chain verify (8 tokens)"] / ms[0]["decode (1 token)"]
    draft = at_256["kinds"]["specblock"]["propose_ms"]["median"] / at_256["verify_ms"]["median"] * chain
    assert at_256["S"] == 256 and config.tree_cost_draft == pytest.approx(draft, rel=0.05)


# ---- drafting -----------------------------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20)])
def test_propose_tree_draws_from_the_block(tiny_target, features, params):
    """Nodes at depth k are the top-b_k tokens of slot k (greedy) or draws from its transformed q_k,
    each node carries its children's distribution, and the tree fits the budget and depth K."""
    drafter = randomised(tiny_target, seed=1, adapt_tree=False)  # the fixed budget: a tree that branches
    tokens, p, K = features.tokens.tolist(), 30, 5
    pool = prefilled(tiny_target, drafter, tokens[:p])
    sampling = SamplingBatch.from_params([params])
    batch = DraftBatch([0], torch.tensor([tokens[p]]), [tokens[: p + 1]], pool, sampling,
                       [torch.Generator().manual_seed(3)])
    ctx = inference_context(drafter, batch, K)
    h, _ = drafter.block_states(ctx, torch.zeros(1, len(drafter.layers), drafter.config.hidden_size))
    logits = drafter.head(h).float()  # (1, K, Vp)
    q = drafter.head.to_full(sampling.probs(logits))[0]  # (K, V)
    tree = drafter.propose_tree(batch, K)
    n = int(tree.num_nodes[0])
    assert 1 <= n <= drafter.config.node_budget and 1 <= int(tree.depths()[0]) <= K
    depth = torch.zeros(n, dtype=torch.long)
    for j in range(n):
        parent = int(tree.parents[0, j])
        depth[j] = 1 if parent < 0 else depth[parent] + 1
    assert len(set(tree.parents[0, :n].tolist())) < n, "the tree never branched"
    torch.testing.assert_close(tree.draft_probs[0, 0], q[0])
    for j in range(n):
        slot = int(depth[j]) - 1  # the node's own token came from slot `slot`
        if params.temperature > 0:  # drawn from q (greedy q is one-hot: later children have q = 0)
            assert float(q[slot, tree.tokens[0, j]]) > 0
        else:
            width = int((tree.parents[0, :n] == tree.parents[0, j]).sum())
            top = drafter.head.to_target_ids(logits[0, slot].topk(width).indices)
            assert int(tree.tokens[0, j]) in top.tolist()
        children = tree.parents[0, :n] == j
        if bool(children.any()):  # a parent's row is the distribution its children came from
            torch.testing.assert_close(tree.draft_probs[0, j + 1], q[slot + 1])


@torch.no_grad()
def test_training_inherits_the_state_decoding_inherits(tiny_target, features):
    """After a prefill at a', a block whose d drafts were accepted leaves slot d's layer inputs to the
    next block (anchor a' + 1 + d); `training_inherited` rebuilds exactly that state from the features."""
    drafter = randomised(tiny_target, seed=2)
    tokens, K = features.tokens, drafter.config.max_draft_len
    for d in (0, 2, K - 1):
        a_prev = 25
        pool = prefilled(tiny_target, drafter, tokens[:a_prev].tolist())
        batch = DraftBatch([0], tokens[a_prev:a_prev + 1], [tokens[:a_prev + 1].tolist()], pool,
                           SamplingBatch.from_params([SamplingParams()]), [torch.Generator()])
        drafter.propose_tree(batch, K)
        # the verify accepted d drafts: x0 and d more tokens join the prefix
        out = tiny_target.model(tokens[None, a_prev:a_prev + 1 + d], pool, [0], drafter.target_layers)
        drafter.commit(pool, [0], out.hidden, torch.tensor([1 + d]))
        decoded = drafter.inherited_of([0], tokens.device)[0]  # (L, H)
        anchors = torch.full((K,), a_prev + 1 + d)  # row n rebuilds the block before with n mod K accepted
        ctx = make_batch(drafter, tiny_target.model, features, anchors, K).ctx
        torch.testing.assert_close(drafter.training_inherited(ctx)[d], decoded, atol=1e-5, rtol=1e-4)
        assert float(decoded.abs().sum()) > 0
        drafter.release(0)
        assert drafter.inherited_of([0], tokens.device).abs().sum() == 0  # forgotten


def test_valid_prefix_mask_stops_the_gradient_after_a_miss(tiny_target, features):
    drafter = randomised(tiny_target, seed=3).train()
    K = drafter.config.max_draft_len
    batch = make_batch(drafter, tiny_target.model, features, torch.tensor([20, 30, 40]), K)
    with torch.no_grad():
        drafted = drafter.head.to_target_ids(drafter.teacher_forced_logits(batch.ctx, batch.prev_tokens).argmax(-1))
    labels = drafted.clone()
    labels[0, 2] = (labels[0, 2] + 1) % tiny_target.config.vocab_size  # row 0 misses at slot 2
    logits, rank_loss = drafter.training_logits(batch.ctx, batch.prev_tokens, labels, batch.valid)
    assert rank_loss.requires_grad and torch.isfinite(rank_loss)
    params = [p for p in drafter.parameters() if p.requires_grad]
    for k, expect in ((2, True), (3, False), (K - 1, False)):
        grads = torch.autograd.grad(logits[0, k].sum(), params, retain_graph=True, allow_unused=True)
        moved = any(g is not None and bool(g.abs().sum() > 0) for g in grads)
        assert moved == expect, k
    grads = torch.autograd.grad(logits[1, K - 1].sum(), params, retain_graph=True, allow_unused=True)
    assert any(g is not None and bool(g.abs().sum() > 0) for g in grads)  # row 1 hit everywhere


# ---- decoding -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("K", [1, 3, 7])
@pytest.mark.parametrize("adapt", [False, True])
def test_greedy_trees_equal_plain_and_branch(tiny_target, K, adapt):
    """Greedy tree-speculative output == plain greedy with trees that branch and differ per row, of the
    fixed budget and of the cost-aware one (priced so that rows and steps take budgets of several sizes)."""
    prompts = [tiny_target.tokenizer.encode_prompt(p) for p in ("hello world, hello", "abcabcabc", "the fox")]
    plain = SpeculativeDecoder(tiny_target.model, create_drafter("none", tiny_target.config), 1, ())
    drafter = randomised(tiny_target, seed=4, node_budget=12, adapt_tree=adapt, tree_cost_per_node=0.02)
    sizes = recording_tree_sizes(drafter)
    spec = SpeculativeDecoder(tiny_target.model, drafter, K, ())
    expected = plain.generate(prompts, SamplingParams(), 30).sequences
    got = spec.generate(prompts, SamplingParams(), 30).sequences
    assert [s.token_ids for s in got] == [s.token_ids for s in expected]
    assert all(0 <= n <= d <= K for s in got for n, d in zip(s.num_accepted, s.num_drafted, strict=True))
    if K > 1:
        assert max(n for step in sizes for n in step) > K, "no tree ever branched"
        assert any(len(set(step)) > 1 for step in sizes), "every step's rows had trees of one size"
        smallest = min(n for step in sizes for n in step)
        assert (smallest < K) == adapt, "only the cost-aware budget cuts trees below a chain of K"


def test_sampled_trees_have_the_target_distribution(vocab8_dir):
    """Chi-square goodness of fit of 3-token continuations with branching trees of the cost-aware budget
    (4,000 samples, K = 2, node budget 6, trees of several sizes). Fails when p < 1e-4: a correct
    implementation fails with probability 1e-4 (fixed seeds, no reruns)."""
    from conftest import assert_samples_follow, exact_joint, load_tiny

    target = load_tiny(vocab8_dir)
    params = SamplingParams(temperature=1.3, top_k=6)
    prompt = [1, 4, 5, 6, 3]
    exact = exact_joint(target, prompt, params, 3)
    N = 4000
    drafter = randomised(target, seed=5, node_budget=6, max_branch=3, draft_vocab_size=8, tree_cost_per_node=0.02)
    steps = recording_tree_sizes(drafter)
    decoder = SpeculativeDecoder(target.model, drafter, 2, eos_token_ids=())
    out = decoder.generate([prompt] * N, params, 3, seeds=range(2000, 2000 + N))
    assert max(sum(s.num_accepted) for s in out.sequences) >= 1
    sizes = {n for step in steps for n in step}
    assert len(sizes) > 1 and max(sizes) > 2, "the trees never branched or never changed size"
    assert_samples_follow([tuple(s.token_ids) for s in out.sequences], exact)


@torch.no_grad()
def test_the_engine_reserves_the_tree_and_keeps_the_inherited_state_across_preemption(tiny_target, features):
    """The engine reserves node budget + 1 positions a step for a tree drafter (a verify writes x0 and
    every node); the inherited state, which a prefill resets to zeros, survives a release and a
    recompute's prefill through `carried_state` / `restore_carried_state` (test_engine.py runs the
    engine with preemption against the single-request loop)."""
    drafter = randomised(tiny_target, seed=6, node_budget=12)
    stages = DecodeStages(tiny_target.model, drafter, 3, ())
    engine = Engine(stages, tiny_target.model.new_pool(16, 8, drafter.num_drafter_layers))
    assert engine.growth == 13
    tokens = features.tokens.tolist()
    pool = tiny_target.model.new_pool(16, 8, drafter.num_drafter_layers)
    stages.prefill(pool, 0, tokens[:20])
    assert drafter.carried_state(0) is None  # zeros after a prefill
    sampling = SamplingBatch.from_params([SamplingParams()])
    result = stages.step(pool, [0], [tokens[:21]], sampling, [torch.Generator()])
    carried = drafter.carried_state(0)
    assert carried is not None and float(carried.abs().sum()) > 0
    verified = tokens[:21] + result.new_tokens[0][:-1]  # the prefix in the pool: x0 and the accepted drafts
    assert len(verified) == pool.length(0)
    stages.release(pool, 0)
    assert drafter.carried_state(0) is None
    stages.prefill(pool, 0, verified)
    assert drafter.carried_state(0) is None  # what a recompute alone would draft from
    drafter.restore_carried_state(0, carried)
    assert torch.equal(drafter.inherited_of([0], carried.device)[0], carried)
    drafter.restore_carried_state(0, None)
    assert drafter.carried_state(0) is None
    with pytest.raises(ValueError, match=r"shape \(5, 64\) \(layers, hidden\) between steps, got \(3,\)"):
        drafter.restore_carried_state(0, torch.zeros(3))
    plain = create_drafter("ngram", tiny_target.config)
    assert plain.carried_state(0) is None
    with pytest.raises(ValueError, match="carries no state"):
        plain.restore_carried_state(0, carried)
