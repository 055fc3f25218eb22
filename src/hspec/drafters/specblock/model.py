"""The SpecBlock drafter: DFlash's block backbone with a layer-wise shift, block-to-block state and a
rank head that shapes a token tree (config.py says which parts come from the abstract).

Forward over a block [x0, MASK x (K-1)] at positions p..p+K-1 (`block_states`):
1. every decoder layer i first adds W_i · RMSNorm_i(x^i_{k-1}) to its input x^i_k: the layer's own
   input at the previous position, normalised (the layer-wise shift). Unnormalised, the shift fed the
   residual stream's growing scale back into it and slot 0 stopped learning (docs/drafters.md). For
   slot 0 the previous position p-1 lies in the previous block: its x^i is the state this sequence
   inherited (step 3), zero after a prefill;
2. the 5 DFlash layers (bidirectional in the block, over the drafter-side context KV), final norm:
   h_k (N, K, H); logits l_k = the target's pruned LM head of h_k; the rank head r_k = W_r h_k.
3. after verification accepts d drafts, the next block's x0 sits at p+1+d and its previous position
   p+d is slot d of this block: the sequence inherits x^i_d of every layer (slot K-1 when all K were
   accepted, the block's last position). `commit` does this; `propose_tree` leaves the states pending.
   A prefill cannot rebuild this state (it depends on where earlier blocks began), so the serving
   engine keeps it across a preemption: `carried_state` / `restore_carried_state`.

Tree (`propose_tree`): slot k's distribution q_k does not depend on the drafts before it (one parallel
block), so every node at depth k gets its children from q_{k+1}'s: b_k children per node, b_k from the
rank head (`tree_branching`), the whole tree within the row's node budget (at most `node_budget`; with
`adapt_tree` the one that maximises the tokens a step is expected to emit per unit of its cost:
tree_shape.py). Greedy rows take the top-b_k tokens (any children keep greedy verification exact);
sampled rows draw b_k i.i.d. children per node from q_k after the target's sampling transform, which is
what tree verification needs to be lossless (decoding/tree_verify.py).

Training (`training_logits`): the block's inherited state is computed as decoding would have left it:
a previous block at anchor p-1-d (d cycles over 0..K-1 across rows) run without gradients, its slot d
taken. The loss of slot k is kept only while every earlier slot's argmax was the label (valid-prefix
mask), by detaching the logits past the first miss, so the reported loss still counts them.

Legend: N rows (B at inference), K block, S context positions, H hidden, Vp pruned vocab, V vocab,
L drafter layers, R = b_max + 1 rank classes, M tree nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hspec.cache.paged_pool import PagedKVPool
from hspec.drafters.base import DRAFTERS, DraftBatch, Proposal, TreeDraft
from hspec.drafters.common import BlockContext
from hspec.drafters.dflash.model import DFlashDrafter
from hspec.drafters.sequential import inference_context
from hspec.drafters.specblock.config import SpecBlockConfig
from hspec.drafters.specblock.tree_shape import cost_aware_budgets, tree_branching
from hspec.drafters.step_cost import StepCost
from hspec.models.layers import RMSNorm
from hspec.sampling import draw_uniforms, sample_with_uniform


@DRAFTERS.register("specblock")
class SpecBlockDrafter(DFlashDrafter):
    """SpecBlock: DFlash + a layer-wise shift carried across blocks + a rank head that shapes a tree."""

    config_class = SpecBlockConfig
    config: SpecBlockConfig
    sequential_head = True  # the trainer calls `training_logits` (inherited state, valid-prefix mask, rank loss)
    proposes_tree = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The trainer hands `BlockContext.history` (the K tokens before x0) to kinds with a history
        # window: training reads the previous block's x0 from it.
        self.history_window = self.config.max_draft_len
        self._inherited: dict[int, torch.Tensor] = {}  # seq_id -> (L, H) x^i at the position before x0
        self._pending: dict[int, torch.Tensor] = {}  # seq_id -> (K, L, H) the last proposal's layer inputs

    def build(self) -> None:
        super().build()  # DFlash: layers, final norm, W_fc and the context norm
        c = self.config
        H = c.hidden_size
        self.shift = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(c.num_layers))  # W_i
        self.shift_norm = nn.ModuleList(RMSNorm(H, c.rms_norm_eps) for _ in range(c.num_layers))  # RMSNorm_i
        for linear in self.shift:
            nn.init.zeros_(linear.weight)  # an untrained shift leaves DFlash unchanged
        self.rank_head = nn.Linear(H, c.max_branch + 1)  # W_r: rank classes 0..b_max-1, then "beyond"

    def draft_positions(self, K: int) -> int:
        return max(K, self.config.node_budget)

    # ---- forward -----------------------------------------------------------------------------------

    def block_states(self, ctx: BlockContext, inherited: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-2: h (N, K, H) normalised output, and each layer's input x^i (N, K, L, H).

        inherited (N, L, H): x^i at the position before x0 (zeros: no previous block).
        """
        if len(ctx.context_kv) != len(self.layers):
            raise ValueError(f"{self.kind!r} reads one context K/V per layer ({len(self.layers)}), "
                             f"got {len(ctx.context_kv)}")
        n, K = ctx.block_tokens.shape
        if inherited.shape != (n, len(self.layers), self.config.hidden_size):
            raise ValueError(f"inherited must be ({n}, {len(self.layers)}, {self.config.hidden_size}), got "
                             f"{tuple(inherited.shape)}")
        x = self.embed_block(ctx.block_tokens)  # (N, K, H)
        cos, sin = self.rope(ctx.positions, x.dtype)  # (N, K, D) each
        states = []
        for i, (layer, shift, norm, context) in enumerate(zip(self.layers, self.shift, self.shift_norm,
                                                              ctx.context_kv)):
            states.append(x)
            prev = torch.cat([inherited[:, i, None].to(x.dtype), x[:, :-1]], 1)  # (N, K, H) x^i at k-1
            x, _ = layer(x + shift(norm(prev)), cos, sin, context, ctx.context_mask)
        return self.norm(x), torch.stack(states, 2)

    def block_logits(self, ctx: BlockContext) -> torch.Tensor:
        """(N, K, Vp) with no previous block (zero inherited state); decoding and training pass the
        state they have (`propose_tree`, `teacher_forced_logits`)."""
        zeros = torch.zeros((ctx.block_tokens.shape[0], len(self.layers), self.config.hidden_size),
                            dtype=self.mask_embedding.dtype, device=ctx.block_tokens.device)
        return self.head(self.block_states(ctx, zeros)[0])

    @torch.no_grad()
    def training_inherited(self, ctx: BlockContext) -> torch.Tensor:
        """(N, L, H): the state decoding would have inherited at each row's anchor (module docstring).

        Row n's previous block had anchor a - 1 - d, d = n mod K, and accepted d drafts; its slot d is
        position a - 1. Needs ctx.history (the K tokens before x0) and training's key layout (key s at
        position s, trainer.make_batch). Rows whose previous anchor would precede the sequence get zeros.
        """
        if ctx.history is None or ctx.history.shape[1] < ctx.K:
            raise ValueError(f"{self.kind!r} training needs BlockContext.history with the {ctx.K} tokens before x0")
        n, K = ctx.block_tokens.shape
        device = ctx.block_tokens.device
        d = torch.arange(n, device=device) % K  # (N,)
        anchor = ctx.positions[:, 0]  # (N,)
        prev_anchor = anchor - 1 - d  # (N,)
        prev_x0 = ctx.history.gather(1, (ctx.history.shape[1] - 1 - d)[:, None])[:, 0]  # (N,) token at a - 1 - d
        ok = (prev_anchor >= 1) & (prev_x0 >= 0)  # (N,)
        block = torch.full_like(ctx.block_tokens, self.config.mask_token_id)
        block[:, 0] = prev_x0.clamp(min=0)
        key_pos = torch.arange(ctx.context_mask.shape[1], device=device)  # (S,)
        window = self.config.sliding_window
        mask = (key_pos[None] < prev_anchor[:, None]) & (key_pos[None] >= prev_anchor[:, None] - window)  # (N, S)
        prev_ctx = BlockContext(block, prev_anchor[:, None] + torch.arange(K, device=device), ctx.last_hidden,
                                ctx.context_kv, mask)
        zeros = torch.zeros((n, len(self.layers), self.config.hidden_size), dtype=self.mask_embedding.dtype,
                            device=device)
        _, states = self.block_states(prev_ctx, zeros)  # (N, K, L, H)
        taken = states[torch.arange(n, device=device), d]  # (N, L, H)
        return torch.where(ok[:, None, None], taken, zeros)

    def teacher_forced_logits(self, ctx: BlockContext, prev_tokens: torch.Tensor) -> torch.Tensor:
        """(N, K, Vp) with the inherited state decoding would have had (`training_inherited`)."""
        return self.head(self.block_states(ctx, self.training_inherited(ctx))[0])

    def training_logits(self, ctx: BlockContext, prev_tokens: torch.Tensor, labels: torch.Tensor,
                        valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter loss's logits under the valid-prefix mask, and the rank head's loss.

        labels (N, K) target ids x_{p+1..p+K}; valid (N, K) bool. Slot k keeps its gradient only while
        slots 0..k-1 all drafted their label (greedily); later slots are detached. The rank head learns
        the rank of the label among slot k's logits (b_max: outside the top b_max or the pruned
        vocabulary) on the same kept slots, from h detached so it does not steer the drafter.
        """
        h, _ = self.block_states(ctx, self.training_inherited(ctx))  # (N, K, H)
        logits = self.head(h)  # (N, K, Vp)
        with torch.no_grad():
            hit = self.head.to_target_ids(logits.argmax(-1)) == labels  # (N, K)
            # slot k is kept when slots 0..k-1 all hit: a cumulative product of the hits shifted right by one
            before = torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1]], 1).long().cumprod(1).bool()  # (N, K)
            keep = before & valid  # (N, K)
            rank = self.label_rank(logits, labels).clamp(max=self.config.max_branch)  # (N, K)
        kept = torch.where(keep[..., None], logits, logits.detach())
        rank_logits = self.rank_head(h.detach()).float()  # (N, K, R)
        ce = F.cross_entropy(rank_logits.flatten(0, 1), rank.flatten(), reduction="none").view_as(rank)
        rank_loss = self.config.rank_loss_weight * (ce * keep).sum() / keep.sum().clamp(min=1)
        return kept, rank_loss

    def label_rank(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(N, K) long: how many draft-vocabulary tokens score above the label; b_max when the label is
        outside the pruned vocabulary. logits (N, K, Vp), labels (N, K) target ids."""
        ids = self.head.draft_vocab_ids  # (Vp,) target id of each draft index
        match = ids[None, None] == labels[..., None]  # (N, K, Vp)
        inside = match.any(-1)  # (N, K)
        label_logit = torch.where(match, logits, torch.full_like(logits, float("-inf"))).amax(-1)  # (N, K)
        rank = (logits > label_logit[..., None]).sum(-1)  # (N, K)
        return torch.where(inside, rank, self.config.max_branch)

    # ---- drafting ----------------------------------------------------------------------------------

    def inherited_of(self, seq_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        """(B, L, H) each sequence's inherited state (zeros after a prefill)."""
        zeros = torch.zeros((len(self.layers), self.config.hidden_size), dtype=self.mask_embedding.dtype,
                            device=device)
        return torch.stack([self._inherited.get(s, zeros) for s in seq_ids])

    def _draft_block(self, batch: DraftBatch, K: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-2 for a proposal: (h (B, K, H), logits (B, K, Vp) fp32); the layer inputs stay pending."""
        ctx = inference_context(self, batch, K)
        h, states = self.block_states(ctx, self.inherited_of(batch.seq_ids, ctx.block_tokens.device))
        for row, seq_id in enumerate(batch.seq_ids):
            self._pending[seq_id] = states[row]
        return h, self.head(h).float()

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        """The chain through the tree's first child at every depth (for callers that verify chains:
        the early-stop and lookup wrappers, `hspec bench draft`)."""
        _, logits = self._draft_block(batch, K)
        local, probs, confidence = self.sample_block(logits, batch.anchor_tokens, batch.sampling, batch.generators)
        return Proposal(self.head.to_target_ids(local), self.head.to_full(probs), confidence=confidence)

    def tree_budgets(self, rank_probs: torch.Tensor, batch: DraftBatch) -> list[int]:
        """Each row's node budget this step: the cost-aware one (tree_shape.py) with `adapt_tree`, else
        `node_budget`. rank_probs (B, K, R)."""
        c = self.config
        if not c.adapt_tree:
            return [c.node_budget] * rank_probs.shape[0]
        cost = StepCost(c.tree_cost_draft, c.tree_cost_per_node, c.tree_cost_per_node_key)
        return cost_aware_budgets(rank_probs, c.rank_coverage, c.node_budget, batch.pool.lengths(batch.seq_ids), cost)

    def propose_tree(self, batch: DraftBatch, K: int) -> TreeDraft:
        """A tree of depth <= K per row, b_k children per node at depth k (module docstring).

        Rows are padded to the batch's largest tree (TreeDraft.num_nodes). A sampled row draws
        `node_budget` uniforms from its own generator whatever its tree, so its draws do not depend on
        the other rows.
        """
        h, logits = self._draft_block(batch, K)  # (B, K, H), (B, K, Vp)
        b = logits.shape[0]
        device = logits.device
        q = batch.sampling.probs(logits)  # (B, K, Vp): one-hot argmax on greedy rows
        rank_probs = torch.softmax(self.rank_head(h).float(), -1)  # (B, K, R)
        branching = tree_branching(rank_probs, self.config.rank_coverage,
                                   self.tree_budgets(rank_probs, batch)).tolist()  # (B, K)
        greedy = (batch.sampling.temperature == 0).tolist()
        uniforms = None if all(greedy) else draw_uniforms(batch.generators, self.config.node_budget, device)
        top = logits.topk(min(self.config.max_branch, logits.shape[-1]), -1).indices  # (B, K, b_max)
        rows = []  # per row: (tokens, parents, slot of each node's children's distribution)
        for row in range(b):
            tokens: list[torch.Tensor] = []
            parents: list[int] = []
            slots: list[int] = []
            leaves, used = [-1], 0
            for k in range(K):
                width = branching[row][k]
                if width == 0:
                    break
                count = len(leaves) * width
                if greedy[row]:
                    children = top[row, k, :width].repeat(len(leaves))  # (count,)
                else:  # i.i.d. draws from q_k, width per leaf
                    assert uniforms is not None  # drawn whenever a row samples
                    children = sample_with_uniform(q[row, k].expand(count, -1), uniforms[row, used:used + count])
                used += count
                start = len(parents)
                tokens.append(children)
                parents += [leaf for leaf in leaves for _ in range(width)]
                slots += [k + 1] * count  # a node at depth k+1 has children drawn from slot k+1
                leaves = list(range(start, start + count))
            rows.append((torch.cat(tokens), parents, slots))
        n = max(len(p) for _, p, _ in rows)
        tokens_t = torch.zeros((b, n), dtype=torch.long, device=device)
        parents_t = torch.full((b, n), -1, dtype=torch.long, device=device)
        slot_t = torch.full((b, n + 1), K, dtype=torch.long, device=device)  # K: a leaf, all-zero row
        for row, (tok, par, slot) in enumerate(rows):
            tokens_t[row, : tok.numel()] = tok
            parents_t[row, : len(par)] = torch.tensor(par, dtype=torch.long, device=device)
            slot_t[row, 0] = 0  # the root's children come from slot 0
            slot_t[row, 1 : len(slot) + 1] = torch.tensor(slot, dtype=torch.long, device=device)
        padded_q = torch.cat([q, torch.zeros_like(q[:, :1])], 1)  # (B, K+1, Vp): row K for leaves
        node_q = padded_q.gather(1, slot_t[..., None].expand(-1, -1, q.shape[-1]))  # (B, M+1, Vp)
        num_nodes = torch.tensor([len(p) for _, p, _ in rows], dtype=torch.long, device=device)
        return TreeDraft(self.head.to_target_ids(tokens_t), parents_t, self.head.to_full(node_q), num_nodes)

    # ---- state across blocks -----------------------------------------------------------------------

    def commit(self, pool: PagedKVPool, seq_ids: Sequence[int], hidden: torch.Tensor | None,
               num_committed: torch.Tensor) -> None:
        """DFlash's commit, then step 3: inherit the pending block's layer inputs at slot d = committed - 1
        (clamped to K-1); after a prefill (nothing pending) the state starts at zero."""
        super().commit(pool, seq_ids, hidden, num_committed)
        counts = num_committed.tolist()
        for seq_id, count in zip(seq_ids, counts):
            pending = self._pending.pop(seq_id, None)
            if pending is None:
                self._inherited.pop(seq_id, None)
            else:
                self._inherited[seq_id] = pending[min(count - 1, pending.shape[0] - 1)]

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self._inherited.pop(seq_id, None)
        self._pending.pop(seq_id, None)

    def carried_state(self, seq_id: int) -> torch.Tensor | None:
        """(L, H): the layer inputs the next block of `seq_id` inherits (step 3); None while it has none
        (zeros, right after a prefill). A prefill cannot rebuild it: it depends on where past blocks began."""
        return self._inherited.get(seq_id)

    def restore_carried_state(self, seq_id: int, state: object | None) -> None:
        """Inherit `state` (from `carried_state`) again, after the prefill of a recompute set it to zeros."""
        if state is None:
            self._inherited.pop(seq_id, None)
            return
        shape = (len(self.layers), self.config.hidden_size)
        if not isinstance(state, torch.Tensor) or tuple(state.shape) != shape:
            got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(f"{self.kind!r} carries a tensor of shape {shape} (layers, hidden) between steps, "
                             f"got {got}")
        self._inherited[seq_id] = state
