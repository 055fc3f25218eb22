"""Tree verification (`hspec.decoding.tree_verify`), the part of SpecBlock's tree drafting that hspec
has: exact against the chain case, greedy as a special case, and the emitted distribution statistically
(fixed seeds, stated false-failure bounds, no reruns)."""

from __future__ import annotations

import pytest
import torch

from hspec.decoding.tree_verify import (
    accepted_tokens,
    tree_attention_mask,
    tree_depths,
    tree_verify,
    tree_verify_greedy,
)
from hspec.decoding.verify import verify
from hspec.sampling import probs_from_logits, sample_with_uniform


def _random_dist(g, *shape):
    x = torch.rand(*shape, generator=g, dtype=torch.float64) ** 3
    x[x < 0.05] = 0.0  # exact zeros, as top-k/top-p truncation produces
    x[..., 0] += 1e-3
    return x / x.sum(-1, keepdim=True)


def test_a_chain_verifies_as_verify_does():
    """The chain tree (parent of node k is k-1) gives `verify`'s result with the same uniforms."""
    g = torch.Generator().manual_seed(0)
    B, K, V = 4000, 4, 7
    p = _random_dist(g, B, K + 1, V).float()
    q = _random_dist(g, B, K, V).float()
    drafts = torch.multinomial(q.flatten(0, 1), 1, generator=g).view(B, K)
    ua, us = torch.rand(B, K, generator=g), torch.rand(B, generator=g)
    chain = verify(p, q, drafts, ua, us)
    parents = torch.arange(-1, K - 1).expand(B, K)
    q_tree = torch.cat([q, torch.zeros(B, 1, V)], 1)  # the last node is a leaf: its row is never read
    tree = tree_verify(p, q_tree, drafts, parents, ua, us)
    assert torch.equal(tree.num_accepted, chain.num_accepted) and torch.equal(tree.next_tokens, chain.next_tokens)
    assert torch.equal(tree.last_node, chain.num_accepted - 1)
    assert len(set(chain.num_accepted.tolist())) == K + 1  # every outcome 0..K occurred


def test_greedy_accepts_the_path_of_target_argmaxes():
    # root children: 3 (node 0), 5 (node 1); node 1's children: 2 (node 2), 4 (node 3); node 3's child: 1 (node 4)
    tokens = torch.tensor([[3, 5, 2, 4, 1]])
    parents = torch.tensor([[-1, -1, 1, 1, 3]])
    argmax = [5, 0, 4, 0, 1, 1]  # after the root, then after node 0 .. node 4 (the last: the bonus)
    p = torch.nn.functional.one_hot(torch.tensor([argmax]), 6).float()
    q = torch.full((1, 6, 6), 1 / 6)  # any q with the children in its support
    result = tree_verify(p, q, tokens, parents, torch.rand(1, 5), torch.rand(1))
    assert result.accepted.tolist() == [[False, True, False, True, True]]
    assert result.last_node.tolist() == [4] and accepted_tokens(result, tokens) == [[5, 4, 1, 1]]
    argmax[2] = 2  # node 1's argmax becomes 2: node 2 accepted (node 3 and 4 not), then node 2's argmax
    p = torch.nn.functional.one_hot(torch.tensor([argmax]), 6).float()
    result = tree_verify(p, q, tokens, parents, torch.rand(1, 5), torch.rand(1))
    assert accepted_tokens(result, tokens) == [[5, 2, 0]]


def test_the_greedy_walk_gives_tree_verify_on_one_hot_distributions():
    """Random trees (padded rows of different sizes) over a vocab of 5, so that many children are the
    target's argmax, ties in the logits included; q one-hot at the draft's own argmax, as greedy drafts are."""
    g = torch.Generator().manual_seed(0)
    B, N, V = 3000, 9, 5
    parents = torch.full((B, N), -1)
    for j in range(1, N):
        parents[:, j] = torch.randint(-1, j, (B,), generator=g)
    tokens = torch.randint(0, V, (B, N), generator=g)
    logits = torch.randint(0, 3, (B, N + 1, V), generator=g).float()  # ties: the first maximum wins
    num_nodes = torch.randint(1, N + 1, (B,), generator=g)
    greedy = (torch.zeros(B), torch.ones(B), torch.zeros(B, dtype=torch.long))  # temperature, top_p, top_k
    p = probs_from_logits(logits, *greedy)
    q = probs_from_logits(torch.randn(B, N + 1, V, generator=g), *greedy)
    full = tree_verify(p, q, tokens, parents, torch.rand(B, N, generator=g), torch.rand(B, generator=g), num_nodes)
    walk = tree_verify_greedy(logits, tokens, parents, num_nodes)
    for field in ("num_accepted", "accepted", "last_node", "next_tokens"):
        assert torch.equal(getattr(walk, field), getattr(full, field)), field
    assert set(walk.num_accepted.tolist()) >= {0, 1, 2, 3}


def test_depths_mask_and_bad_parents():
    parents = torch.tensor([[-1, -1, 1, 1, 3]])
    assert tree_depths(parents).tolist() == [[1, 1, 2, 2, 3]]
    mask = tree_attention_mask(parents)[0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 1, 0, 1, 0], [0, 1, 0, 1, 1]]
    with pytest.raises(ValueError, match=r"parents\[0, 2\] = 2"):
        tree_depths(torch.tensor([[-1, 0, 2]]))


def test_emitted_tokens_have_the_target_distribution():
    """A tree of 3 i.i.d. root children, each with 2 i.i.d. children, over V = 5 and a target that
    depends on the previous token: the first two emitted tokens are distributed as p(x1) p(x2 | x1).

    400k trees; every one of the 25 joint frequencies must lie within 5 standard errors of the
    exact probability: false-failure probability below 25 * 6e-7 (Gaussian tail, fixed seed).
    """
    g = torch.Generator().manual_seed(2)
    V, N = 5, 400_000
    p_first = _random_dist(g, V).float()
    p_next = _random_dist(g, V, V).float()  # p_next[a] = the target after token a
    p_third = _random_dist(g, V, V).float()  # after a grandchild token (its own distribution)
    q_root = _random_dist(g, V).float()
    q_child = _random_dist(g, V, V).float()  # q_child[a]: how children of a node holding a are drawn
    root_children = torch.multinomial(q_root, 3 * N, replacement=True, generator=g).view(N, 3)
    grand = torch.multinomial(q_child[root_children.flatten()], 2, replacement=True, generator=g).view(N, 3, 2)
    # nodes: 0..2 the root's children, then for child c its two children at 3 + 2c, 4 + 2c
    tokens = torch.cat([root_children, grand.flatten(1)], 1)  # (N, 9)
    parents = torch.tensor([-1, -1, -1, 0, 0, 1, 1, 2, 2]).expand(N, 9)
    target = torch.cat([p_first.expand(N, 1, V), p_next[root_children], p_third[grand.flatten(1)]], 1)  # (N, 10, V)
    draft = torch.cat([q_root.expand(N, 1, V), q_child[root_children], torch.zeros(N, 6, V)], 1)
    result = tree_verify(target, draft, tokens, parents, torch.rand(N, 9, generator=g), torch.rand(N, generator=g))
    # The second token: the accepted path's second node, or the next token when the path has one node;
    # when no node was accepted the first token is the next token, and a second one is drawn from p_next.
    depth = result.num_accepted
    rows = torch.arange(N)
    path_nodes = torch.where(result.accepted, torch.arange(9), 99).sort(1).values  # accepted nodes first
    first = torch.where(depth >= 1, tokens[rows, path_nodes[:, 0].clamp(max=8)], result.next_tokens)
    extra = sample_with_uniform(p_next[first], torch.rand(N, generator=g))
    second = torch.where(depth >= 2, tokens[rows, path_nodes[:, 1].clamp(max=8)],
                         torch.where(depth == 1, result.next_tokens, extra))
    freq = torch.bincount(first * V + second, minlength=V * V).double() / N
    exact = (p_first[:, None] * p_next).flatten().double()
    se = (exact * (1 - exact) / N).sqrt()
    assert ((freq - exact).abs() <= 5 * se + 1e-12).all()
    assert int((depth == 2).sum()) > N // 10 and int((depth == 0).sum()) > 0  # both ways were exercised


# ---- a tree step against the target (decoding/tree_step.py) ---------------------------------------------


def random_tree(generators, vocab_size: int, branching=(3, 2), sharpness: float = 2.0):
    """A tree of i.i.d. children: `branching[d]` children per node at depth d, each drawn from that
    node's own random q (one q per node, from the row's generator)."""
    from hspec.decoding.tree_step import TreeDraft

    rows_tokens, rows_parents, rows_q = [], [], []
    for g in generators:
        tokens, parents, qs = [], [], [torch.softmax(sharpness * torch.randn(vocab_size, generator=g), -1)]
        frontier = [-1]
        for width in branching:
            next_frontier = []
            for node in frontier:
                q = qs[node + 1]
                for _ in range(width):
                    tokens.append(int(torch.multinomial(q, 1, generator=g)))
                    parents.append(node)
                    qs.append(torch.softmax(sharpness * torch.randn(vocab_size, generator=g), -1))
                    next_frontier.append(len(tokens) - 1)
            frontier = next_frontier
        rows_tokens.append(tokens)
        rows_parents.append(parents)
        rows_q.append(torch.stack(qs))
    return TreeDraft(torch.tensor(rows_tokens), torch.tensor(rows_parents), torch.stack(rows_q))


def tree_generate(target, prompts, params, max_new_tokens, seeds, branching=(3, 2)):
    """Prefill, then tree steps until every row has `max_new_tokens` tokens (no EOS)."""
    from hspec.decoding.tree_step import tree_step
    from hspec.sampling import SamplingBatch

    model = target.model
    b = len(prompts)
    pool = model.new_pool(num_pages=b * 8, page_size=8)
    sampling = SamplingBatch.from_params([params] * b)
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    drafts = [torch.Generator().manual_seed(10_000 + s) for s in seeds]
    for i in range(b):
        pool.add_sequence(i)
    with torch.no_grad():
        logits = model(torch.tensor(prompts), pool, list(range(b)), last_logits_only=True).logits[:, -1]
        first = sample_with_uniform(sampling.probs(logits[:, None])[:, 0],
                                    torch.stack([torch.rand(1, generator=g)[0] for g in generators]))
        outputs = [[int(t)] for t in first]
        depths = []
        while min(len(o) for o in outputs) < max_new_tokens:
            anchors = torch.tensor([o[-1] for o in outputs])
            step = tree_step(model, pool, list(range(b)), anchors, random_tree(drafts, target.config.vocab_size,
                                                                                   branching), sampling, generators)
            for o, new in zip(outputs, step.new_tokens):
                o.extend(new)
            depths += step.verified.num_accepted.tolist()
    return [o[:max_new_tokens] for o in outputs], depths, pool, outputs


def test_greedy_tree_decoding_equals_plain(vocab8_dir):
    """Greedy: tree steps (3 x 2 random i.i.d. children, vocab 8 so that paths of 1 and 2 are accepted)
    emit exactly the plain greedy tokens; the KV of accepted paths is moved into place each step."""
    from conftest import load_tiny
    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.drafters import create_drafter
    from hspec.sampling import SamplingParams

    target = load_tiny(vocab8_dir)
    prompts = [[1, 4, 5, 6, 3], [1, 2, 7, 7, 3], [1, 3, 3, 5, 6]]
    plain = SpeculativeDecoder(target.model, create_drafter("none", target.config), 1, eos_token_ids=())
    expected = [s.token_ids for s in plain.generate(prompts, SamplingParams(), 30).sequences]
    got, depths, pool, outputs = tree_generate(target, prompts, SamplingParams(), 30, seeds=[1, 2, 3])
    assert got == expected
    assert {1, 2} <= set(depths), "no path of length 1 and 2 was accepted"
    # The pool holds exactly the K/V a fresh prefill of each row's tokens (prompt + all but x0) writes.
    for row, (prompt, out) in enumerate(zip(prompts, outputs)):
        tokens = prompt + out[:-1]
        assert pool.length(row) == len(tokens)
        fresh = target.model.new_pool(num_pages=8, page_size=8)
        fresh.add_sequence(0)
        with torch.no_grad():
            target.model(torch.tensor([tokens]), fresh, [0])
        for layer in range(target.config.num_layers):
            k, v = pool.gather(layer, pool.slot_table([row]))
            fk, fv = fresh.gather(layer, fresh.slot_table([0]))
            torch.testing.assert_close(k, fk, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(v, fv, atol=1e-5, rtol=1e-4)


def test_sampled_tree_decoding_has_the_target_distribution(vocab8_dir):
    """Chi-square goodness of fit of 3-token continuations (4,000 samples, temperature 1.3, top-k 6),
    as for the chain case (test_generate.py): fails when p < 1e-4, so a correct implementation fails
    with probability 1e-4; fixed seeds, no reruns."""
    from conftest import assert_samples_follow, exact_joint, load_tiny
    from hspec.sampling import SamplingParams

    target = load_tiny(vocab8_dir)
    params = SamplingParams(temperature=1.3, top_k=6)
    prompt = [1, 4, 5, 6, 3]
    exact = exact_joint(target, prompt, params, 3)
    N = 4000
    samples, depths, _, _ = tree_generate(target, [prompt] * N, params, 3, seeds=range(1000, 1000 + N))
    assert_samples_follow([tuple(s) for s in samples], exact)
    assert sum(d >= 2 for d in depths) > N // 20  # deep paths were accepted, so the KV moves were exercised


@torch.no_grad()
def test_tree_step_hands_the_accepted_path_hidden_states_in_order(tiny_target):
    """The hidden states a tree step returns for [x0 ; accepted path] equal a chain forward's."""
    from hspec.decoding.tree_step import TreeDraft, tree_step
    from hspec.sampling import SamplingBatch, SamplingParams

    model = tiny_target.model
    prompt = [1, 5, 9, 13, 2, 40]
    pool = model.new_pool(8, 8)
    pool.add_sequence(0)
    x0 = int(model(torch.tensor([prompt]), pool, [0]).logits[0, -1].argmax())
    # The target's own greedy continuation as the second child's path, decoys around it.
    ref_pool = model.new_pool(8, 8)
    ref_pool.add_sequence(0)
    ref = model(torch.tensor([prompt + [x0]]), ref_pool, [0], (1, 3))
    t1 = int(ref.logits[0, -1].argmax())
    ref2 = model(torch.tensor([[t1]]), ref_pool, [0], (1, 3))
    t2 = int(ref2.logits[0, -1].argmax())
    decoy = (t1 + 1) % 96
    tokens = torch.tensor([[decoy, t1, decoy, t2]])  # nodes: 0, 1 children of x0; 2, 3 children of node 1
    parents = torch.tensor([[-1, -1, 1, 1]])
    q = torch.full((1, 5, 96), 1 / 96)
    step = tree_step(model, pool, [0], torch.tensor([x0]), TreeDraft(tokens, parents, q),
                     SamplingBatch.from_params([SamplingParams()]), [torch.Generator()], target_layers=(1, 3))
    assert step.new_tokens[0][:2] == [t1, t2] and int(step.num_committed[0]) == 3
    ref3 = model(torch.tensor([[t2]]), ref_pool, [0], (1, 3))
    expected = torch.cat([ref.hidden[:, -1:], ref2.hidden, ref3.hidden], 1)  # (1, 3, 2, H): x0, t1, t2 as a chain
    torch.testing.assert_close(step.hidden, expected, atol=1e-5, rtol=1e-4)
    assert pool.length(0) == len(prompt) + 3
