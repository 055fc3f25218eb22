"""Token trees from a block drafter's distributions: `KIND:tree` (`hspec:tree`, `dflash:tree`, `dspark:tree`).

A block drafter (H-Spec, DFlash, DSpark) computes in one forward a distribution for every draft position,
and its chain keeps the argmax of each. Where the drafter is unsure, the target's token is often its second
or third candidate; a tree verifies several candidates at once (DDTree; EAGLE-2's dynamic trees), and the
target keeps the longest path it agrees with (decoding/tree_step.py, tree_verify.py). Per step, per row:

1. One block forward: the backbone logits U_k, k = 1..K (`NeuralDrafter.block_logits`).
2. A greedy row's tree grows best first. A node's value is the product of the drafter's probabilities
   along its path, its estimate that the target accepts the whole path. The children of a node at depth
   k - 1 with token t are the top `BRANCH` tokens of softmax(l_k), l_k = U_k + W2(W1[t]) in H-Spec, whose
   Markov head conditions every branch on its parent token (`NeuralDrafter.slot_logits`; U_k alone in
   DFlash and DSpark), each worth its parent's value times its probability. The candidate of highest
   value joins the tree next; as a child never outweighs its parent, the values join in falling order.
3. The tree stops growing when the next node would not raise the step's expected tokens per unit of cost,

       E(N) = 1 + sum of the N nodes' values,   cost(N) = StepCost.of(N, S, K)   (drafters/step_cost.py),

   the same costs `KIND:auto` reads (measured once per machine, `hspec.runtime.step_cost_of`), or at
   `max_nodes`. With falling values the first node that does not pay ends the best tree of this order.
4. When even that tree emits less than one token per decode's cost, drafting does not pay for the row: it
   skips the next 1, 2, 4, ... up to 32 steps (the back-off of `KIND:auto`, drafters/cost_aware.py), which
   verify x0 alone, a plain decode, without running the drafter for it.
5. A sampled row verifies the drafter's chain, drawn as `KIND` draws it, as a tree of one child per node:
   tree verification of a chain is the chain's own rejection sampling, so the output distribution is the
   target's; only greedy rows branch (a sampled tree's children would have to be independent draws).

The tree depends on the row's own context and drafts only, never on the target's verdict or the other
rows, so a greedy output stays the target's token for token.

Legend: B rows, K depth (block slots), Vp draft vocabulary, N nodes.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from hspec.drafters.base import DraftBatch, Proposal, TreeDraft
from hspec.drafters.common import NeuralDrafter
from hspec.drafters.cost_aware import Backoff, RowStateDrafter
from hspec.drafters.step_cost import StepCost

TREE = "tree"  # the suffix of `KIND:tree`
BRANCH = 4  # candidates a node offers for its children
MAX_NODES = 16  # most nodes a tree may hold


def grow_tree(backbone: torch.Tensor, anchor: int, drafter: NeuralDrafter, cost: StepCost, keys: int,
              max_nodes: int = MAX_NODES) -> tuple[list[int], list[int], list[float], float]:
    """One greedy row's tree (module docstring, steps 2-3): node tokens (draft-vocabulary ids), parents (-1
    = a child of x0) and values, in the order they joined, which is topological, and the tree's rate E / cost
    in tokens per decode's cost.

    backbone: (K, Vp) the row's U_k; anchor: x0 (a target id)."""
    K, device = backbone.shape[0], backbone.device
    tokens: list[int] = []
    parents: list[int] = []
    values: list[float] = []
    candidates: list[tuple[float, int, int, int]] = []  # (-value, order, parent node, token), a max-heap
    order = itertools.count()  # ties go to the candidate offered first

    def offer(parent: int, depth: int, parent_token: int, parent_value: float) -> None:
        if depth >= K:
            return
        prev = torch.tensor([parent_token], device=device)  # (1,) a target id
        logits = drafter.slot_logits(backbone[depth][None], prev)[0].float()  # (Vp,)
        probs, top = torch.softmax(logits, -1).topk(min(BRANCH, logits.shape[-1]))
        for prob, token in zip(probs.tolist(), top.tolist()):
            heapq.heappush(candidates, (-parent_value * prob, next(order), parent, token))

    depth_of: list[int] = []
    offer(-1, 0, anchor, 1.0)
    emitted, rate = 1.0, 1.0 / cost.of(0, keys, K)  # the backbone drafted K positions
    while candidates and len(tokens) < max_nodes:
        value = -candidates[0][0]
        grown = (emitted + value) / cost.of(len(tokens) + 1, keys, K)
        if tokens and grown <= rate:  # the first node always joins: the step drafts
            break
        _, _, parent, token = heapq.heappop(candidates)
        tokens.append(token)
        parents.append(parent)
        values.append(value)
        depth_of.append(0 if parent < 0 else depth_of[parent] + 1)
        emitted, rate = emitted + value, grown
        target_id = int(drafter.head.to_target_ids(torch.tensor(token, device=device)))
        offer(len(tokens) - 1, depth_of[-1] + 1, target_id, value)
    return tokens, parents, values, rate


class BlockTreeDrafter(RowStateDrafter):
    """`model`'s drafts as a cost-aware token tree per greedy row, its chain per sampled row (module docstring)."""

    proposes_tree = True

    def __init__(self, model: NeuralDrafter, cost: StepCost, max_nodes: int = MAX_NODES) -> None:
        if not isinstance(model, NeuralDrafter) or model.proposes_tree:
            raise ValueError(f"drafter {model.kind!r} is not a block drafter with a distribution per position; "
                             f"{TREE!r} takes a trained chain kind such as hspec, dflash or dspark")
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        super().__init__(model)
        self.cost = cost
        self.max_nodes = max_nodes
        self.kind = f"{model.kind}:{TREE}"  # `_rows`: each sequence's back-off (step 4)

    def draft_positions(self, K: int) -> int:
        return max(K, self.max_nodes)

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        """The model's chain (for callers that verify chains, e.g. `hspec bench draft`)."""
        return self.model.propose(batch, K)

    @torch.inference_mode()
    def propose_tree(self, batch: DraftBatch, K: int) -> TreeDraft:
        model = self.model
        assert isinstance(model, NeuralDrafter)  # checked in __init__
        device = batch.anchor_tokens.device
        greedy = (batch.sampling.temperature == 0).tolist()
        states = [self._state(s) for s in batch.seq_ids]
        turns = [state.takes_turn() for state in states]
        drafting = [row for row, turn in enumerate(turns) if turn or not greedy[row]]
        rows: list[tuple[list[int], list[int]]] = [([], [])] * len(states)  # (tokens, parents) per row
        chain_probs: dict[int, torch.Tensor] = {}  # sampled row -> (K, Vp) its chain's distributions
        if drafting:
            sub = batch.select(drafting)
            backbone = model.block_logits(model.block_context(sub, K))  # (N, K, Vp)
            sampled = [i for i, row in enumerate(drafting) if not greedy[row]]
            if sampled:
                chain, probs, _ = model.sample_block(backbone, sub.anchor_tokens, sub.sampling,
                                                     sub.generators)  # (N, K), (N, K, Vp)
                for i in sampled:
                    rows[drafting[i]] = (chain[i].tolist(), list(range(-1, K - 1)))
                    chain_probs[drafting[i]] = probs[i]
            keys = batch.pool.lengths(sub.seq_ids)
            for i, row in enumerate(drafting):
                if greedy[row]:
                    tokens, parents, _, rate = grow_tree(backbone[i], int(sub.anchor_tokens[i]), model, self.cost,
                                                         keys[i], self.max_nodes)
                    rows[row] = (tokens, parents)
                    states[row].after_draft(rate, Backoff())
        n = max(1, max(len(tokens) for tokens, _ in rows))  # a batch where nobody drafts verifies padding
        local = torch.zeros((len(rows), n), dtype=torch.long, device=device)  # (B, N)
        parents_t = torch.full((len(rows), n), -1, dtype=torch.long, device=device)  # (B, N)
        for row, (tokens, parents) in enumerate(rows):
            local[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=device)
            parents_t[row, : len(parents)] = torch.tensor(parents, dtype=torch.long, device=device)
        num_nodes = torch.tensor([len(tokens) for tokens, _ in rows], dtype=torch.long, device=device)
        if not chain_probs:  # all greedy: verified from the target's argmaxes, no distribution is read
            node_q = torch.zeros((1, 1, 1), device=device).expand(len(rows), n + 1, model.config.vocab_size)
            return TreeDraft(model.head.to_target_ids(local), parents_t, node_q, num_nodes)
        # A greedy row's q stays 0: its child is then accepted iff it is the target's argmax (tree_verify.py).
        # A chain's node j has children drawn from slot j + 1, x0's from slot 0.
        vp = next(iter(chain_probs.values())).shape[-1]
        q = torch.zeros((len(rows), n + 1, vp), dtype=torch.float32, device=device)  # (B, N+1, Vp)
        for row, probs in chain_probs.items():
            q[row, :K] = probs
        return TreeDraft(model.head.to_target_ids(local), parents_t, model.head.to_full(q), num_nodes)
