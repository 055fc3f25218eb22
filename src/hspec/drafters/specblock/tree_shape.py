"""The shape of SpecBlock's token tree: how many children each depth gets (`tree_branching`, from the rank
head) and how many nodes a row's tree may have (`cost_aware_budgets`).

Branching. The rank head gives, at slot k, the distribution of the rank of the target's token among the
drafter's candidates (R = b_max + 1 classes, the last "beyond b_max"). b_k is the smallest b whose coverage
c_k(b) = P(rank < b) reaches `rank_coverage`, cut depth by depth so the tree fits its node budget.

Budget. SpecBlock's abstract says a cost-aware bandit adapts the tree online and gains 3-6 points of speed
with it; nothing more of it is public. A larger tree accepts more but costs more to verify, and on a CPU the
verify of a 17-token tree costs 1.3-2.3 decodes against 1.1-1.5 for an 8-token chain
(`results/tree_verify/`). hspec's adaptation is deterministic and per row, so that a row's output depends
neither on timings nor on the other rows of its batch: each step, each row takes the budget n <= node_budget
whose tree maximises the tokens the step is expected to emit per unit of its expected cost,

    E[emitted](n) = 1 + sum_k prod_{j<=k} c_j(b_j(n))      (the rank head is trained on valid prefixes only,
                                                            so c_k is conditional on slots 1..k-1 being right)
    cost(n)       = draft + 1 + nodes(n) * (per_node + per_node_key * S)   (in 1-token decodes; S: keys)

`StepCost` (drafters/step_cost.py) holds the three cost coefficients (SpecBlockConfig's tree_cost_* fields),
with nodes(n) as its verified tokens.

Legend: N rows, K depth (block slots), R rank classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import takewhile

import torch

from hspec.drafters.step_cost import StepCost, expected_emitted


def _wanted_branching(rank_probs: torch.Tensor, coverage: float) -> tuple[list[list[int]], torch.Tensor]:
    """b_k before any budget, per row (N lists of K), and the coverages c_k(b) (N, K, b_max)."""
    b_max = rank_probs.shape[-1] - 1
    cover = rank_probs.float().cumsum(-1)[..., :b_max]  # (N, K, b_max): P(rank < b) for b = 1..b_max
    want = (1 + (cover < coverage).sum(-1)).clamp(max=b_max).tolist()  # (N, K)
    return want, cover


def _fit(want: Sequence[int], node_budget: int) -> list[int]:
    """One row's b_k cut depth by depth to `node_budget` nodes; once a depth cannot give every leaf a
    child, the tree ends there (b = 0 from then on)."""
    nodes, leaves, shape = 0, 1, []
    for b in want:
        b = min(b, (node_budget - nodes) // leaves)
        if b < 1 or (shape and shape[-1] == 0):
            b = 0
        nodes, leaves = nodes + leaves * b, leaves * max(b, 1)
        shape.append(b)
    return shape


def tree_branching(rank_probs: torch.Tensor, coverage: float, node_budget: int | Sequence[int]) -> torch.Tensor:
    """Children per node at each depth, (N, K) long, from the rank head's distribution (N, K, R).

    b_k = smallest b in 1..b_max whose coverage P(rank < b) >= `coverage` (b_max if none), then cut to
    `node_budget` (one for every row, or one per row) as `_fit` says.
    """
    want, _ = _wanted_branching(rank_probs, coverage)
    budgets = [node_budget] * len(want) if isinstance(node_budget, int) else list(node_budget)
    if len(budgets) != len(want):
        raise ValueError(f"node_budget has {len(budgets)} entries for {len(want)} rows")
    out = [_fit(row, budget) for row, budget in zip(want, budgets)]
    return torch.tensor(out, dtype=torch.long, device=rank_probs.device)


def tree_nodes(shape: Sequence[int]) -> int:
    """Nodes of a tree with b_k children per node at depth k."""
    nodes, leaves = 0, 1
    for b in shape:
        if b == 0:
            break
        leaves *= b
        nodes += leaves
    return nodes


def tree_expected_emitted(shape: Sequence[int], cover: Sequence[Sequence[float]]) -> float:
    """1 + sum_k prod_{j<=k} c_j(b_j): tokens a step emits on average with this shape; cover (K, b_max)."""
    reached = takewhile(lambda b: b > 0, shape)  # the tree ends at its first 0
    return expected_emitted([cover[k][b - 1] for k, b in enumerate(reached)])


def cost_aware_budgets(rank_probs: torch.Tensor, coverage: float, max_budget: int, keys: Sequence[int],
                       cost: StepCost) -> list[int]:
    """Per row, the node budget in 1..max_budget whose tree maximises E[emitted] / cost (module docstring);
    the smallest such budget on ties. keys: each row's context length S."""
    want, cover = _wanted_branching(rank_probs, coverage)
    if len(keys) != len(want):
        raise ValueError(f"keys has {len(keys)} entries for {len(want)} rows")
    positions = rank_probs.shape[1]  # the block drafted: K
    budgets = []
    for wanted, row_cover, s in zip(want, cover.tolist(), keys):  # Python lists: this runs every step
        best, best_score = 1, -1.0
        for budget in range(1, max_budget + 1):
            shape = _fit(wanted, budget)
            score = tree_expected_emitted(shape, row_cover) / cost.of(tree_nodes(shape), s, positions)
            if score > best_score:
                best, best_score = budget, score
        budgets.append(best)
    return budgets
