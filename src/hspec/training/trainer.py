"""The unified training recipe for every drafter kind (docs/design.md#training, paper App. B.3).

One step:
1. pick `seqs_per_step` training sequences and, in each, `anchors_per_seq` random anchors p in the
   response (a block [x_p, MASK x (K-1)] at positions p..p+K-1 whose slots predict x_{p+1..p+K});
2. every anchor is one row: it sees the target's context strictly before p (its own sequence only,
   within the sliding window) and its own block — rows never see each other, which is the
   block-diagonal packing of the paper written as a batch;
3. loss = weighted 0.1 CE + 0.9 TV (training/losses.py), teacher-forced Markov inputs; under
   `precision="bf16-autocast"` the drafter's forward runs in bf16 autocast while the weights, the
   optimizer state, the loss and the target's distribution stay fp32 (training/precision.py);
4. gradients averaged over sequences (and over processes under torchrun: all-reduce over the
   process group, gloo on CPU and nccl on GPU), clipped to norm 1, AdamW step with 1% linear warmup
   then half-cosine to 0.

Randomness is derived from (seed, step, sequence slot), so a resumed run draws exactly what an uninterrupted
one would; checkpoints hold the weights, the optimizer state and the step.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hspec.drafters.common import BlockContext, NeuralDrafter, build_block
from hspec.metrics import AcceptanceStats, acceptance_stats, merge_stats
from hspec.models.llama import TargetModel
from hspec.training.features import SequenceFeatures, TeacherDistribution
from hspec.training.losses import LossWeights, drafter_loss, greedy_acceptance
from hspec.training.precision import PRECISION_CHOICES, precision_context, resolve_precision


@dataclass(frozen=True)
class TrainConfig:
    """The recipe. Defaults are the paper's where it states them."""

    steps: int = 1000  # optimizer steps; the same for every drafter of a comparison
    lr: float = 6e-4  # peak learning rate
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    warmup_fraction: float = 0.01  # linear warmup over this share of the steps, then half-cosine to 0
    seqs_per_step: int = 4  # sequences per optimizer step (per process)
    anchors_per_seq: int = 16  # blocks drawn per sequence
    seed: int = 0
    loss: LossWeights = field(default_factory=LossWeights)
    cod_keep: bool = False  # P-Eagle's COD sampling: keep max(0.6^d, 0.2) of anchors at depth d
    precision: str = "fp32"  # fp32 | bf16-autocast | auto (training/precision.py); a run records the resolved one

    def __post_init__(self) -> None:
        for name in ("steps", "seqs_per_step", "anchors_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.precision not in PRECISION_CHOICES:
            raise ValueError(f"precision must be one of {', '.join(PRECISION_CHOICES)}, got {self.precision!r}")


def learning_rate(step: int, config: TrainConfig) -> float:
    """lr at optimizer step `step` (0-based): linear warmup, then half-cosine decay to 0."""
    warmup = max(1, round(config.warmup_fraction * config.steps))
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def step_generator(seed: int, step: int, slot: int) -> torch.Generator:
    """The random source of one sequence slot of one step (stateless, so resume is exact)."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{step}:{slot}".encode()))


@dataclass(frozen=True)
class Batch:
    """The rows of one sequence's blocks: everything the loss needs."""

    ctx: BlockContext
    prev_tokens: torch.Tensor  # (N, K) teacher-forced Markov inputs [x_p, x_{p+1}, ..., x_{p+K-1}]
    labels: torch.Tensor  # (N, K) x_{p+1..p+K}
    teacher: TeacherDistribution  # the target at the label positions: on_vocab (N, K, Vp), argmax (N, K)
    valid: torch.Tensor  # (N, K) bool: label inside the sequence (and kept by COD sampling)


def sample_anchors(feats: SequenceFeatures, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct anchors p in the response with 1 <= p <= S-2, sorted, (N,)."""
    s = feats.tokens.shape[0]
    low, high = max(feats.prompt_length, 1), s - 2
    if high < low:
        return torch.empty(0, dtype=torch.long)
    candidates = torch.arange(low, high + 1)
    pick = torch.randperm(candidates.numel(), generator=generator)[:count]
    return candidates[pick].sort().values


def context_kv_for(drafter: NeuralDrafter, feats: SequenceFeatures, rows: int
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Context K/V for `rows` blocks of one sequence, each (rows, S, Hkv, D) (expanded views).

    Kinds with their own context KV compute it from the target hidden states (with gradients);
    kinds that reuse the target's K/V read the cached target layers.
    """
    s = feats.tokens.shape[0]
    positions = torch.arange(s, device=feats.tokens.device)[None]  # (1, S)
    target_kv = {layer: (k[None], v[None]) for layer, (k, v) in feats.kv.items()}  # each (1, S, Hkv, D)
    pairs = drafter.context_kv_from_features(feats.tokens[None], feats.hidden[None], positions, target_kv)
    return [(k.expand(rows, *k.shape[1:]), v.expand(rows, *v.shape[1:])) for k, v in pairs]


def draft_head_rows(drafter: NeuralDrafter, target: TargetModel) -> torch.Tensor:
    """(Vp, H): the target LM head's rows of the drafter's vocabulary, which the teacher reads."""
    return target.lm_head_weight().detach()[drafter.head.draft_vocab_ids]


def make_batch(drafter: NeuralDrafter, target: TargetModel, feats: SequenceFeatures, anchors: torch.Tensor,
               K: int, cod_generator: torch.Generator | None = None, head_rows: torch.Tensor | None = None) -> Batch:
    """Blocks at `anchors` (N,) of one sequence (see module docstring, step 1-2), on the features' device.

    `anchors` may lie on the CPU (they are drawn there, from a seeded CPU generator). The teacher reads
    the features' teacher summary (computed here when `feats` lack it; `Trainer.load` gives features
    that hold it) and `head_rows` (`draft_head_rows`; gathered here when None, while `Trainer` keeps
    them, as the gather costs tens of ms on a CPU).
    """
    feats = feats.with_teacher(target)
    tokens = feats.tokens
    device = tokens.device
    anchors = anchors.to(device)
    s = tokens.shape[0]
    n = anchors.shape[0]
    block_tokens, positions = build_block(tokens[anchors], anchors, K, drafter.config.mask_token_id)
    key_pos = torch.arange(s, device=device)
    window = drafter.config.sliding_window
    context_mask = (key_pos[None] < anchors[:, None]) & (key_pos[None] >= anchors[:, None] - window)  # (N, S)
    history_len = drafter.history_window  # DeLS-Spec's local head reads the W tokens before x0
    history = None
    if history_len:
        index = anchors[:, None] - history_len + torch.arange(history_len, device=device)  # (N, W)
        history = torch.where(index >= 0, tokens[index.clamp(min=0)], -1)
    ctx = BlockContext(block_tokens, positions, feats.hidden[anchors - 1], context_kv_for(drafter, feats, n),
                       context_mask, history)
    offsets = torch.arange(K, device=device)
    label_pos = anchors[:, None] + 1 + offsets  # (N, K)
    valid = label_pos <= s - 1
    label_pos = label_pos.clamp(max=s - 1)
    prev_tokens = tokens[(anchors[:, None] + offsets).clamp(max=s - 1)]
    if cod_generator is not None:
        # P-Eagle's COD sampling: depth d keeps a max(0.6^d, 0.2) share of the anchors, nested (one
        # draw per anchor, so a kept depth implies every shallower depth is kept too).
        keep = torch.tensor([max(0.6**d, 0.2) for d in range(K)])
        valid &= (torch.rand((n, 1), generator=cod_generator) < keep).to(device)
    if head_rows is None:
        head_rows = draft_head_rows(drafter, target)
    return Batch(ctx, prev_tokens, tokens[label_pos], feats.teacher(head_rows, label_pos - 1), valid)


def all_reduce_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Average gradients over the process group (no-op in a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world


@dataclass
class StepLog:
    step: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    ce: list[float]
    tv: list[float]


class Trainer:
    """Runs the recipe for one drafter over a list of sequence loaders."""

    def __init__(self, drafter: NeuralDrafter, target: TargetModel, load_sequence: Callable[[int], SequenceFeatures],
                 train_ids: Sequence[int], config: TrainConfig, rank: int = 0, world_size: int = 1) -> None:
        if not train_ids:
            raise ValueError("no training sequences")
        self.drafter, self.target, self.load_sequence = drafter, target, load_sequence
        # The target is frozen: without this a tied LM head would get a full-vocabulary weight gradient
        # every step (the target's distribution is computed from it), costing more than the drafter.
        target.requires_grad_(False)
        self.train_ids, self.config = list(train_ids), config
        self.rank, self.world_size = rank, world_size
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr, betas=(0.9, 0.95), fused=all(p.device.type in ("cpu", "cuda") for p in self.params))
        self.K = drafter.config.max_draft_len
        self.device = drafter.head.draft_vocab_ids.device  # where the drafter lives; features are moved there
        self.precision = resolve_precision(config.precision, self.device)  # never 'auto'
        self.head_rows = draft_head_rows(drafter, target)  # (Vp, H); the vocabulary is fixed from here on

    def load(self, seq: int) -> SequenceFeatures:
        """Sequence `seq`'s features on the drafter's device, with the teacher's summary."""
        return self.load_sequence(seq).to(self.device).with_teacher(self.target)

    def sequences_for_step(self, step: int) -> list[tuple[int, int]]:
        """This process's (slot, sequence) pairs at `step`: one seeded draw for all ranks, sharded by rank.

        The slot (the sequence's index in the global draw) seeds its anchors, so a run on N processes
        draws exactly the blocks a single process would.
        """
        g = step_generator(self.config.seed, step, -1)
        total = self.config.seqs_per_step * self.world_size
        order = torch.randint(len(self.train_ids), (total,), generator=g).tolist()
        slots = list(range(total))[self.rank::self.world_size]
        return [(slot, self.train_ids[order[slot]]) for slot in slots]

    def compute_gradients(self, step: int) -> tuple[float, list[float], list[float]]:
        """Forward + backward of one step's sequences; returns (loss, ce by position, tv by position).

        Each sequence's backbone runs on its own (its rows share that sequence's context K/V); the
        Markov head then runs once over every row of the step, so the dense (V, r) gradient of its
        embedding is built once a step rather than once per sequence. The forward runs in the run's
        precision; the sum of the logits and the loss are fp32 whatever it is.
        """
        pairs = self.sequences_for_step(step)
        with precision_context(self.precision, self.device):
            batches, backbone, corrections, own_losses = self._forward(step, pairs)
        total = sum((loss.float() / len(pairs) for loss in own_losses), torch.zeros((), device=self.device))
        ce_sum, tv_sum = torch.zeros(self.K, device=self.device), torch.zeros(self.K, device=self.device)
        if not batches:
            return 0.0, ce_sum.tolist(), tv_sum.tolist()
        if corrections is not None:
            split = corrections.split([u.shape[0] for u in backbone])
            backbone = [u.float() + c.float() for u, c in zip(backbone, split)]
        for batch, logits in zip(batches, backbone):
            parts = drafter_loss(logits, batch.teacher.on_vocab, batch.labels, self.drafter.head.draft_vocab_ids,
                                 batch.valid, self.config.loss)
            total = total + parts.loss / len(pairs)
            ce_sum += parts.ce / len(pairs)
            tv_sum += parts.tv / len(pairs)
        total.backward()  # one backward a step
        return float(total.detach()), ce_sum.tolist(), tv_sum.tolist()

    def _forward(self, step: int, pairs: list[tuple[int, int]]
                 ) -> tuple[list[Batch], list[torch.Tensor], torch.Tensor | None, list[torch.Tensor]]:
        """The drafter's forward over one step's sequences.

        Returns (batches, backbone logits per batch, each (N_i, K, Vp), the Markov head's corrections of
        every row (sum N_i, K, Vp) or None, the kind's own extra losses).
        """
        batches, backbone, own_losses = [], [], []
        for slot, seq in pairs:
            g = step_generator(self.config.seed, step, slot)
            feats = self.load(seq)
            anchors = sample_anchors(feats, self.config.anchors_per_seq, g)
            if anchors.numel() == 0:
                continue
            cod = g if self.config.cod_keep else None
            batch = make_batch(self.drafter, self.target, feats, anchors, self.K, cod, self.head_rows)
            batches.append(batch)
            if self.drafter.sequential_head:
                # Slot k depends on the previous token through more than an additive Markov term
                # (DFly, DFlash-2, DeLS-Spec): such a kind teacher-forces its own head and may add a
                # loss of its own (DFlash-2's path-selector cross-entropy).
                logits, own_loss = self.drafter.training_logits(batch.ctx, batch.prev_tokens, batch.labels,
                                                                batch.valid)
                backbone.append(logits)  # (N_i, K, Vp)
                if own_loss is not None:
                    own_losses.append(own_loss)
            else:
                backbone.append(self.drafter.block_logits(batch.ctx))  # (N_i, K, Vp)
        corrections = self.drafter.markov_logits(torch.cat([b.prev_tokens for b in batches])) if batches else None
        return batches, backbone, corrections, own_losses

    def train_step(self, step: int) -> StepLog:
        start = time.perf_counter()
        self.drafter.train()
        lr = learning_rate(step, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss, ce, tv = self.compute_gradients(step)
        all_reduce_gradients(self.params)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip))
        self.optimizer.step()
        return StepLog(step, loss, lr, grad_norm, time.perf_counter() - start, ce, tv)

    @torch.no_grad()
    def validate(self, val_ids: Sequence[int], anchors_per_seq: int = 32) -> AcceptanceStats:
        """Greedy acceptance per position on held-out sequences (fixed anchors)."""
        self.drafter.eval()
        stats = []
        for seq in val_ids:
            feats = self.load(seq)
            anchors = sample_anchors(feats, anchors_per_seq, step_generator(self.config.seed, -1, seq))
            if anchors.numel() == 0:
                continue
            batch = make_batch(self.drafter, self.target, feats, anchors, self.K, head_rows=self.head_rows)
            full = batch.valid.all(-1)  # only blocks whose K labels all exist
            if not bool(full.any()):
                continue
            logits = self.drafter.teacher_forced_logits(batch.ctx, batch.prev_tokens)
            accepted = greedy_acceptance(logits[full], batch.teacher.argmax[full], self.drafter.head.draft_vocab_ids)
            stats.append(acceptance_stats(accepted, self.K))
        if not stats:
            raise ValueError("no validation blocks: validation sequences are too short")
        return merge_stats(stats)

    @torch.no_grad()
    def validate_in_decode_order(self, val_ids: Sequence[int], rows_per_forward: int = 64) -> AcceptanceStats:
        """Greedy acceptance of the blocks greedy decoding itself would draft on held-out sequences.

        The responses are the target's greedy outputs, so decoding them with this drafter visits a
        known chain of anchors: the first response token, then, after n accepted drafts, the anchor
        n + 1 positions later, until a block would pass the end of the sequence. `validate` weights
        every anchor alike; this weights them as decoding does (steps, not tokens), so its tau is
        what `hspec generate` would measure on these prompts. A region where drafts are accepted
        yields fewer steps, which is why this tau is the lower of the two.
        """
        self.drafter.eval()
        chain_steps = []
        for seq in val_ids:
            feats = self.load(seq)
            s = feats.tokens.shape[0]
            last_anchor = s - 1 - self.K  # the last anchor whose K labels all exist
            if last_anchor < feats.prompt_length:
                continue
            accepted: list[int] = []  # at every anchor the chain may visit, in order
            for chunk in torch.arange(feats.prompt_length, last_anchor + 1, device=self.device).split(rows_per_forward):
                batch = make_batch(self.drafter, self.target, feats, chunk, self.K, head_rows=self.head_rows)
                logits = self.drafter.teacher_forced_logits(batch.ctx, batch.prev_tokens)
                accepted += greedy_acceptance(logits, batch.teacher.argmax, self.drafter.head.draft_vocab_ids).tolist()
            p = 0  # index into anchors
            while p < len(accepted):
                chain_steps.append(accepted[p])
                p += accepted[p] + 1
        if not chain_steps:
            raise ValueError("no validation blocks: validation sequences are too short")
        return acceptance_stats(chain_steps, self.K)
