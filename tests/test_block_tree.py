"""Token trees from a block drafter's distributions (`KIND:tree`, drafters/block_tree.py).

Greedy equality with plain decoding and the sampled distribution of `hspec:tree` and `dflash:tree` are in
test_generate.py's grids; here: how a tree grows, that it branches, and the names.
"""

from __future__ import annotations

import math

import pytest
import torch

from hspec.drafters.block_tree import BlockTreeDrafter, grow_tree
from hspec.drafters.spec import parse_drafter_spec
from hspec.drafters.step_cost import StepCost


class _Head:
    def to_target_ids(self, local: torch.Tensor) -> torch.Tensor:
        return local


class _Drafter:
    """slot_logits: the backbone's logits, plus a bonus for token (parent + 1) % V (a Markov-like term)."""

    head = _Head()

    def slot_logits(self, backbone: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        bonus = torch.zeros_like(backbone)
        bonus[0, (int(prev[0]) + 1) % backbone.shape[-1]] = 2.0
        return backbone + bonus


def test_the_tree_grows_best_first_and_stops_at_the_first_node_that_does_not_pay():
    K, V = 3, 6
    backbone = torch.zeros(K, V)  # every token equally likely but for the parent's successor
    p_next = math.exp(2) / (math.exp(2) + V - 1)  # the successor's probability, ~0.6
    p_other = 1 / (math.exp(2) + V - 1)  # ~0.08
    free = StepCost(draft=0.0, per_token=0.0, per_token_key=0.0)
    tokens, parents, values, _ = grow_tree(backbone, 0, _Drafter(), free, keys=0, max_nodes=5)
    # free nodes: always the next best; the chain 1 -> 2 -> 3 first (0.6, 0.36, 0.22), then siblings
    assert tokens[:3] == [1, 2, 3] and parents[:3] == [-1, 0, 1]
    assert values[:3] == pytest.approx([p_next, p_next ** 2, p_next ** 3])
    assert values[3:] == pytest.approx([p_other] * 2) and len(tokens) == 5
    assert values == sorted(values, reverse=True)
    # at 0.15 a decode per node, a node pays while its value beats ~0.15 x the rate: the chain, no sibling
    dear = StepCost(draft=0.5, per_token=0.15, per_token_key=0.0)
    tokens, parents, _, _ = grow_tree(backbone, 0, _Drafter(), dear, keys=0)
    assert (tokens, parents) == ([1, 2, 3], [-1, 0, 1])
    # however dear, the first node joins: a step of `:tree` always drafts
    assert len(grow_tree(backbone, 0, _Drafter(), StepCost(5.0, 5.0, 0.0), keys=0)[0]) == 1


def _greedy_and_sampled_rows(tiny_target, drafter):
    from hspec.drafters.base import DraftBatch
    from hspec.sampling import SamplingBatch, SamplingParams

    pool = tiny_target.model.new_pool(8, 16, drafter.num_drafter_layers)
    prompt = tiny_target.tokenizer.encode_prompt("Hello there")
    for seq in (0, 1):
        pool.add_sequence(seq)
        pool.extend([seq], len(prompt))
    hidden = torch.zeros(2, len(prompt), len(drafter.target_layers), tiny_target.config.hidden_size)
    drafter.commit(pool, [0, 1], hidden, torch.tensor([len(prompt)] * 2))
    params = [SamplingParams(), SamplingParams(temperature=1.0)]
    return DraftBatch([0, 1], torch.tensor([prompt[-1]] * 2), [prompt, prompt], pool,
                      SamplingBatch.from_params(params, "cpu"), [torch.Generator().manual_seed(s) for s in (0, 1)])


def test_greedy_rows_branch_and_sampled_rows_verify_their_chain(tiny_target):
    from hspec.drafters import create_drafter

    model = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    drafter = BlockTreeDrafter(model, StepCost(draft=0.0, per_token=0.001, per_token_key=0.0), max_nodes=12)
    tree = drafter.propose_tree(_greedy_and_sampled_rows(tiny_target, drafter), 4)
    assert tree.num_nodes.tolist() == [12, 4]  # cheap nodes: the greedy row fills its budget; the sampled row: K
    assert tree.depths().tolist()[0] < 12  # ... as a tree, not a chain
    assert tree.parents[1, :4].tolist() == [-1, 0, 1, 2]
    assert torch.allclose(tree.draft_probs[1, :4].sum(-1), torch.ones(4))  # the chain's distributions


def test_a_greedy_row_whose_tree_does_not_pay_backs_off_and_follows_a_preemption(tiny_target):
    from hspec.drafters import create_drafter

    model = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    drafter = BlockTreeDrafter(model, StepCost(draft=3.0, per_token=1.0, per_token_key=0.0))
    batch = _greedy_and_sampled_rows(tiny_target, drafter)
    assert drafter.propose_tree(batch, 4).num_nodes.tolist() == [1, 4]  # the first node joins anyway
    carried = drafter.carried_state(0)
    assert drafter.propose_tree(batch, 4).num_nodes.tolist() == [0, 4]  # then a plain decode step for it
    drafter.release(0)  # a preemption: the state leaves with the sequence ...
    drafter.restore_carried_state(0, carried)
    assert drafter.propose_tree(batch, 4).num_nodes.tolist() == [0, 4]  # ... and comes back with it
    drafter.release(0)  # a new sequence under the same id starts afresh
    hidden = torch.zeros(1, 3, len(drafter.target_layers), tiny_target.config.hidden_size)
    drafter.commit(batch.pool, [0], hidden, torch.tensor([3]))
    assert drafter.propose_tree(batch, 4).num_nodes.tolist() == [1, 4]


@pytest.mark.parametrize("name, match", [("hspec+ngram:tree", "alone"), ("ngram:tree", "trained block drafter")])
def test_tree_names_refuse_what_cannot_grow_a_tree(name, match):
    assert parse_drafter_spec("hspec:tree").tree
    with pytest.raises(ValueError, match=match):
        parse_drafter_spec(name)
