"""One speculative step with a drafted token tree: verify the tree in one target forward, keep the
accepted path in the KV pool, and emit its tokens plus the next one.

Steps (the chain step's stages, docs/design.md#the-decoding-step, for a tree):
1. the target runs [x0 ; the N nodes] with the tree's ancestor mask (`TargetModel.forward(tree_mask=)`),
   node j at position p + depth(j); its K/V land in slots p+1 .. p+N in node order;
2. `tree_verify` walks the tree against the target's distributions (lossless: tree_verify.py);
3. the accepted path's K/V move to positions p+1 .. p+d (a node at depth i was given RoPE position
   p + i, where it now lies, so the copy is exact) and the pool is rolled back to p + 1 + d.

A tree drafter (`Drafter.proposes_tree`, e.g. SpecBlock) hands the step a `TreeDraft` (drafters/base.py);
at T > 0 the children of each node must be independent draws from that node's draft distribution
(tree_verify.py).

Legend: B batch, N tree nodes, V vocab, L target layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hspec.cache.paged_pool import PagedKVPool
from hspec.decoding.tree_verify import TreeVerifyResult, tree_attention_mask, tree_verify, tree_verify_greedy
from hspec.drafters.base import TreeDraft
from hspec.models.llama import TargetModel
from hspec.sampling import SamplingBatch, draw_uniforms


@dataclass(frozen=True)
class TreeStepResult:
    new_tokens: list[list[int]]  # per row: the accepted path's tokens, then the recovered/bonus token
    verified: TreeVerifyResult
    # (B, 1 + max d, n_sel, H): hidden states of [x0 ; accepted path] in path order, of which the first
    # 1 + d of each row were committed (what `Drafter.commit` takes); None without target_layers.
    hidden: torch.Tensor | None
    num_committed: torch.Tensor  # (B,) 1 + d


def tree_step(model: TargetModel, pool: PagedKVPool, seq_ids: Sequence[int], anchor_tokens: torch.Tensor,
              draft: TreeDraft, sampling: SamplingBatch, generators: Sequence[torch.Generator],
              target_layers: Sequence[int] = (), num_uniforms: int | None = None) -> TreeStepResult:
    """Verify `draft` after each row's anchor x0 (B,), which is not yet in the pool (module docstring).

    Draws `num_uniforms` (default N + 1, at least N + 1) uniforms per row from the row's own generator,
    whatever is accepted: a caller whose trees vary in size passes the largest tree it can draft + 1, so
    a row's draws depend neither on the other rows nor on its own tree's size. `target_layers`: target
    layers whose hidden states of the committed positions the result carries.
    """
    b, n = draft.tokens.shape
    count = n + 1 if num_uniforms is None else num_uniforms
    if count < n + 1:
        raise ValueError(f"num_uniforms must be >= N + 1 = {n + 1}, got {num_uniforms}")
    device = draft.tokens.device
    starts = pool.lengths(seq_ids)  # p per row: x0 goes to position p
    # 1. [x0 ; nodes] as a tree rooted at x0: node j's parent j' becomes j' + 1, x0's children point at 0.
    parents = torch.cat([torch.full((b, 1), -1, device=device), draft.parents + 1], 1)  # (B, N+1)
    parents[:, 1:] = torch.where(draft.parents < 0, 0, parents[:, 1:])
    input_ids = torch.cat([anchor_tokens[:, None].to(device), draft.tokens], 1)  # (B, N+1)
    out = model(input_ids, pool, seq_ids, target_layers, tree_mask=tree_attention_mask(parents))
    # 2. verification
    uniforms = draw_uniforms(generators, count, device)  # (B, count >= N+1)
    if sampling.all_greedy:  # the same verdict as `tree_verify` on one-hot distributions, without building them
        result = tree_verify_greedy(out.logits, draft.tokens, draft.parents, draft.num_nodes)
    else:
        target_probs = sampling.probs(out.logits)  # (B, N+1, V)
        result = tree_verify(target_probs, draft.draft_probs.to(target_probs.dtype), draft.tokens, draft.parents,
                             uniforms[:, :n], uniforms[:, count - 1], draft.num_nodes)
    # 3. keep the accepted path: node j (position p + 1 + j in slot order) -> position p + 1 + its depth - 1
    table = pool.slot_table(seq_ids)
    layers = pool.num_target_layers
    for row, seq_id in enumerate(seq_ids):
        path = result.accepted[row].nonzero()[:, 0]  # (d,) node indices, root to leaf
        d = path.numel()
        if d:
            src = table.slots[row, starts[row] + 1 + path]  # (d,)
            dst = table.slots[row, starts[row] + 1 + torch.arange(d, device=device)]  # (d,)
            pool.k[:layers, dst] = pool.k[:layers, src].clone()
            pool.v[:layers, dst] = pool.v[:layers, src].clone()
        pool.truncate(seq_id, starts[row] + 1 + d)
    tokens = [draft.tokens[row][result.accepted[row]].tolist() + [int(result.next_tokens[row])] for row in range(b)]
    hidden = None
    if out.hidden is not None:
        # [x0 ; path] in path order: accepted node indices sorted (a path is in topological order), padded.
        order = torch.where(result.accepted, torch.arange(n, device=device) + 1, n + 1).sort(1).values  # (B, N)
        index = torch.cat([torch.zeros((b, 1), dtype=torch.long, device=device), order], 1)  # (B, N+1)
        index = index[:, : 1 + int(result.num_accepted.max())].clamp(max=n)
        hidden = out.hidden.gather(1, index[:, :, None, None].expand(-1, -1, *out.hidden.shape[2:]))
    return TreeStepResult(tokens, result, hidden, result.num_accepted + 1)
