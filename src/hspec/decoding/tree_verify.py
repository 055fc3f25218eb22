"""Tree verification: which path of a drafted token tree the target accepts, and the token after it.

A tree drafter (SpecBlock, EAGLE-2, DDTree) proposes several continuations that share prefixes. Its
N nodes are listed in topological order (a node's parent comes before it, siblings in the order they
were drafted); node j holds a token and the index of its parent (-1: a child of the root, the anchor
x0). The target scores every node in one forward with an ancestor mask (`tree_attention_mask`), at
positions p + depth (`tree_depths`), which gives p_root (the target's distribution after x0) and
p_j (after node j).

Verification walks down from the root (SpecInfer, Miao et al. 2024, multi-step speculative
sampling): at the current node with distribution p' (p of that node at first) and draft
distribution q (the distribution the node's children were drawn from), the children are tried in
order; child x is accepted with probability min(1, p'(x) / q(x)); on a rejection p' becomes the
residual norm(max(0, p' - q)) and the next child is tried; an accepted child becomes the current
node, with p' = its own p. When no child is accepted (or the node is a leaf), the next token is
drawn from p'. If the children of a node are independent draws from q, every emitted token has
exactly the target's distribution; greedy is the special case of one-hot p (a child is accepted iff
it is the target's argmax), which holds for any children.

A chain of K drafts is the tree whose node k has parent k-1: then this is `verify` exactly, with the
same uniforms (tested).

Legend: B batch, N tree nodes, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hspec.decoding.verify import residual_dist
from hspec.sampling import greedy_tokens, sample_with_uniform


@dataclass(frozen=True)
class TreeVerifyResult:
    """num_accepted: (B,) accepted nodes (the depth of the accepted path).
    accepted: (B, N) bool, the accepted nodes: a path from the root, in node order.
    last_node: (B,) the deepest accepted node, -1 when none was.
    next_tokens: (B,) the token drawn after the accepted path (recovered or bonus).
    """

    num_accepted: torch.Tensor
    accepted: torch.Tensor
    last_node: torch.Tensor
    next_tokens: torch.Tensor


def check_parents(parents: torch.Tensor) -> None:
    """parents (B, N) long: -1 or an earlier node's index (topological order); raises ValueError."""
    if parents.dim() != 2:
        raise ValueError(f"parents must be (B, N), got shape {tuple(parents.shape)}")
    n = parents.shape[1]
    index = torch.arange(n, device=parents.device)
    bad = (parents < -1) | (parents >= index)
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"parents[{b}, {j}] = {int(parents[b, j])}: a node's parent must be -1 (the root) or an "
                         f"earlier node 0..{j - 1}")


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """(B, N) depth of each node, 1 for children of the root; with x0 at position p, node j sits at p + depth."""
    check_parents(parents)
    b, n = parents.shape
    depth = torch.zeros((b, n), dtype=torch.long, device=parents.device)
    for j in range(n):  # parents come first, so their depth is known
        parent = parents[:, j]
        depth[:, j] = torch.where(parent < 0, 1, depth.gather(1, parent.clamp(min=0)[:, None])[:, 0] + 1)
    return depth


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """(B, N, N) bool: [b, i, j] is True when node j is node i or one of its ancestors.

    What node i's query may see among the tree's nodes (it also sees the whole verified prefix and x0).
    """
    check_parents(parents)
    b, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    for j in range(n):
        parent = parents[:, j]
        has = parent >= 0
        inherited = mask[torch.arange(b, device=parents.device), parent.clamp(min=0)]  # (B, N) the parent's row
        mask[:, j] |= inherited & has[:, None]
    return mask


def tree_verify(target_probs: torch.Tensor, draft_probs: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                uniform_accept: torch.Tensor, uniform_sample: torch.Tensor,
                num_nodes: torch.Tensor | None = None) -> TreeVerifyResult:
    """Verify a batch of drafted trees (module docstring).

    target_probs: (B, N+1, V): [:, 0] the target after x0, [:, j+1] after node j.
    draft_probs: (B, N+1, V): [:, 0] the distribution the root's children were drawn from, [:, j+1] that
        of node j's children (rows of leaves are never read).
    tokens: (B, N) long, node tokens. parents: (B, N) long, -1 or an earlier node.
    uniform_accept: (B, N) in [0, 1), one per node's acceptance test; uniform_sample: (B,) in [0, 1).
    num_nodes: (B,) long, row b's tree is its first num_nodes[b] nodes (the rest is padding, never
        tried, so rows of one batch may have trees of different sizes); None: every node is real.
    """
    b, n1, v = target_probs.shape
    n = n1 - 1
    if draft_probs.shape != (b, n1, v) or tokens.shape != (b, n) or parents.shape != (b, n):
        raise ValueError(f"shapes disagree: target_probs {tuple(target_probs.shape)}, draft_probs "
                         f"{tuple(draft_probs.shape)}, tokens {tuple(tokens.shape)}, parents {tuple(parents.shape)}")
    check_parents(parents)
    rows = torch.arange(b, device=target_probs.device)
    current = torch.full((b,), -1, dtype=torch.long, device=target_probs.device)  # the node we stand at
    p_res = target_probs[:, 0]  # (B, V) p' at the current node
    accepted = torch.zeros((b, n), dtype=torch.bool, device=target_probs.device)
    real = torch.full((b,), n, device=target_probs.device) if num_nodes is None else num_nodes.to(target_probs.device)
    for j in range(n):
        tried = (parents[:, j] == current) & (j < real)  # (B,) node j is a real child of the current node
        q = draft_probs[rows, current + 1]  # (B, V)
        x = tokens[:, j]
        # u < p'/q, written without a division; q > 0 for any token actually drawn from q.
        take = tried & (uniform_accept[:, j] * q[rows, x] < p_res[rows, x])
        reject = tried & ~take
        p_res = torch.where(reject[:, None], residual_dist(p_res, q), p_res)
        p_res = torch.where(take[:, None], target_probs[:, j + 1], p_res)
        current = torch.where(take, j, current)
        accepted[:, j] = take
    next_tokens = sample_with_uniform(p_res, uniform_sample)
    return TreeVerifyResult(accepted.sum(1), accepted, current, next_tokens)


def tree_verify_greedy(target_logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       num_nodes: torch.Tensor | None = None) -> TreeVerifyResult:
    """`tree_verify` for a batch of greedy rows, from the target's logits, without distributions.

    With one-hot p, `tree_verify` accepts a child exactly when it is the target's argmax at its parent
    (a rejection leaves p' one-hot where it was, whatever q), and the next token is the argmax after the
    accepted path; this walks the tree on the argmaxes alone, skipping the (B, N+1, V) one-hots and
    residuals (`decoding.verify.greedy_verdict` for a chain).

    target_logits: (B, N+1, V), [:, 0] after x0 and [:, j+1] after node j; tokens, parents (B, N) and
    num_nodes as in `tree_verify`.
    """
    b, n1, _ = target_logits.shape
    n = n1 - 1
    if tokens.shape != (b, n) or parents.shape != (b, n):
        raise ValueError(f"shapes disagree: target_logits {tuple(target_logits.shape)}, tokens "
                         f"{tuple(tokens.shape)}, parents {tuple(parents.shape)}")
    check_parents(parents)
    best = greedy_tokens(target_logits)  # (B, N+1)
    rows = torch.arange(b, device=best.device)
    current = torch.full((b,), -1, dtype=torch.long, device=best.device)  # the node we stand at
    accepted = torch.zeros((b, n), dtype=torch.bool, device=best.device)
    real = torch.full((b,), n, device=best.device) if num_nodes is None else num_nodes.to(best.device)
    for j in range(n):
        take = (parents[:, j] == current) & (j < real) & (tokens[:, j] == best[rows, current + 1])  # (B,)
        current = torch.where(take, j, current)
        accepted[:, j] = take
    return TreeVerifyResult(accepted.sum(1), accepted, current, best[rows, current + 1])


def accepted_tokens(result: TreeVerifyResult, tokens: torch.Tensor) -> list[list[int]]:
    """Per row, the tokens of the accepted path followed by the next token (what the step emits)."""
    out = []
    for row in range(tokens.shape[0]):
        path = tokens[row][result.accepted[row]].tolist()
        out.append(path + [int(result.next_tokens[row])])
    return out
