"""The unified training recipe for every drafter kind (docs/design.md#training, paper App. B.3).

One step:
1. pick `seqs_per_step` training sequences and, in each, `anchors_per_seq` random anchors p in the
   response (a block [x_p, MASK x (K-1)] at positions p..p+K-1 whose slots predict x_{p+1..p+K});
2. every anchor is one row: it sees the target's context strictly before p (its own sequence only,
   within the sliding window) and its own block — rows never see each other, which is the
   block-diagonal packing of the paper written as a batch. All the step's rows are one batch, one
   forward: each sequence's context is made once and read by all its rows (`make_step_batch`);
3. loss = weighted 0.1 CE + 0.9 TV (training/losses.py), teacher-forced Markov inputs; under
   `precision="bf16-autocast"` the drafter's forward runs in bf16 autocast while the weights, the
   optimizer state, the loss and the target's distribution stay fp32 (training/precision.py);
4. losses averaged within each sequence, then over sequences (and gradients over processes under
   torchrun: all-reduce over the process group, gloo on CPU and nccl on GPU), clipped to norm 1, AdamW
   step with 1% linear warmup then half-cosine to 0.

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
from hspec.training.features import SequenceFeatures, TeacherDistribution, teacher_at
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
    compile: bool = False  # the step's forward and loss through torch.compile (`Trainer.step_loss`)

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
    """The rows of one step's blocks (or of one sequence's): everything the loss needs.

    The rows are `groups` groups of equal size, one per sequence, in the order the sequences were given;
    a sequence with fewer anchors than the others is filled up with padding rows (`valid` all False).
    """

    ctx: BlockContext  # context_kv holds one context per group, (G, S, Hkv, D) (`attend_block`)
    prev_tokens: torch.Tensor  # (N, K) teacher-forced Markov inputs [x_p, x_{p+1}, ..., x_{p+K-1}]
    labels: torch.Tensor  # (N, K) x_{p+1..p+K}
    teacher: TeacherDistribution  # the target at the label positions: on_vocab (N, K, Vp), argmax (N, K)
    valid: torch.Tensor  # (N, K) bool: label inside the sequence (and kept by COD sampling)
    groups: int = 1  # G: sequences; N = G * A rows


def sample_anchors(feats: SequenceFeatures, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `count` distinct anchors p in the response with 1 <= p <= S-2, sorted, (N,)."""
    s = feats.tokens.shape[0]
    low, high = max(feats.prompt_length, 1), s - 2
    if high < low:
        return torch.empty(0, dtype=torch.long)
    candidates = torch.arange(low, high + 1)
    pick = torch.randperm(candidates.numel(), generator=generator)[:count]
    return candidates[pick].sort().values


def draft_head_rows(drafter: NeuralDrafter, target: TargetModel) -> torch.Tensor:
    """(Vp, H): the target LM head's rows of the draft vocabulary, which the teacher reads."""
    return target.lm_head_weight().detach()[drafter.head.draft_vocab_ids]


@dataclass(frozen=True)
class PaddedSequences:
    """G sequences' features stacked, each padded with zeros to the longest length S (views for G = 1)."""

    lengths: torch.Tensor  # (G,) long, each sequence's own length
    tokens: torch.Tensor  # (G, S) long
    hidden: torch.Tensor  # (G, S, n_sel, H)
    final_hidden: torch.Tensor  # (G, S, H)
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # pool layer -> (k, v), each (G, S, Hkv, D)
    target_lse: torch.Tensor  # (G, S)
    target_argmax: torch.Tensor  # (G, S)

    @staticmethod
    def of(feats: Sequence[SequenceFeatures]) -> PaddedSequences:
        """`feats` (with the teacher's summary) stacked."""
        lengths = [f.tokens.shape[0] for f in feats]
        s = max(lengths)

        def stack(parts: list[torch.Tensor]) -> torch.Tensor:  # each (S_i, ...) -> (G, S, ...)
            if len(parts) == 1:
                return parts[0][None]
            out = parts[0].new_zeros((len(parts), s, *parts[0].shape[1:]))
            for i, t in enumerate(parts):
                out[i, :t.shape[0]] = t
            return out

        layers = feats[0].kv.keys()
        return PaddedSequences(
            torch.tensor(lengths, device=feats[0].tokens.device), stack([f.tokens for f in feats]),
            stack([f.hidden for f in feats]), stack([f.final_hidden for f in feats]),
            {layer: (stack([f.kv[layer][0] for f in feats]), stack([f.kv[layer][1] for f in feats]))
             for layer in layers},
            stack([f.target_lse for f in feats]),  # type: ignore[misc]
            stack([f.target_argmax for f in feats]))  # type: ignore[misc]


def make_step_batch(drafter: NeuralDrafter, target: TargetModel, feats: Sequence[SequenceFeatures],
                    anchors: Sequence[torch.Tensor], K: int,
                    cod_generators: Sequence[torch.Generator | None] | None = None,
                    head_rows: torch.Tensor | None = None) -> Batch:
    """The blocks at anchors[i] (N_i,) of every sequence feats[i], as one batch (module docstring, steps 1-2).

    Row g * A + j is block j of sequence g, A = max N_i (padding rows fill up the shorter lists). Each
    sequence's context (the target's K/V, or the kind's own computed from its hidden states) is made
    once, (G, S, Hkv, D), and all its rows read it (`attend_block`'s grouped form): one drafter forward
    a step, with products of all the step's rows, rather than one small forward per sequence over
    copies of its context. Anchors may lie on the CPU (drawn from a seeded CPU generator);
    `cod_generators[i]` (None: no COD sampling) draws sequence i's COD keeps exactly as `make_batch`
    draws them. The teacher reads the features' teacher summary (computed here when they lack it) and
    `head_rows` (`draft_head_rows`; gathered here when None, while `Trainer` keeps them, as the gather
    costs tens of ms on a CPU). Everything is made on the features' device.
    """
    if not feats or len(anchors) != len(feats):
        raise ValueError(f"need one anchor list per sequence, got {len(feats)} sequences, {len(anchors)} lists")
    feats = [f.with_teacher(target) for f in feats]
    padded = PaddedSequences.of(feats)
    device = padded.tokens.device
    G, S = padded.tokens.shape
    A = max(a.numel() for a in anchors)
    # 1. Rows: padding rows get anchor 1 (every index below stays inside the sequence) and no valid label.
    anchor = torch.ones((G, A), dtype=torch.long)
    real = torch.zeros((G, A), dtype=torch.bool)
    keep = torch.ones((G, A, K), dtype=torch.bool)  # COD sampling's kept depths
    for g, a in enumerate(anchors):
        anchor[g, :a.numel()], real[g, :a.numel()] = a.cpu(), True
        generator = cod_generators[g] if cod_generators is not None else None
        if generator is not None:
            # P-Eagle's COD sampling: depth d keeps a max(0.6^d, 0.2) share of the anchors, nested (one
            # draw per anchor, so a kept depth implies every shallower depth is kept too).
            depth_keep = torch.tensor([max(0.6**d, 0.2) for d in range(K)])
            keep[g, :a.numel()] = torch.rand((a.numel(), 1), generator=generator) < depth_keep
    anchor, real, keep = anchor.view(-1).to(device), real.view(-1).to(device), keep.view(-1, K).to(device)  # (N,..)
    base = torch.arange(G, device=device).repeat_interleave(A) * S  # (N,) where each row's sequence starts
    length = padded.lengths.repeat_interleave(A)  # (N,)
    tokens = padded.tokens.view(-1)  # (G*S,)
    # 2. The block, its context and what the loss compares it with.
    block_tokens, positions = build_block(tokens[base + anchor], anchor, K, drafter.config.mask_token_id)
    key_pos = torch.arange(S, device=device)
    window = drafter.config.sliding_window
    context_mask = (key_pos[None] < anchor[:, None]) & (key_pos[None] >= anchor[:, None] - window)  # (N, S)
    history_len = drafter.history_window  # DeLS-Spec's local head reads the W tokens before x0
    history = None
    if history_len:
        index = anchor[:, None] - history_len + torch.arange(history_len, device=device)  # (N, W)
        history = torch.where(index >= 0, tokens[base[:, None] + index.clamp(min=0)], -1)
    context_kv = drafter.context_kv_from_features(padded.tokens, padded.hidden,
                                                  key_pos[None].expand(G, S), padded.kv)  # [(G, S, Hkv, D)]
    last_hidden = padded.hidden.flatten(0, 1)[base + anchor - 1]  # (N, n_sel, H)
    ctx = BlockContext(block_tokens, positions, last_hidden, context_kv, context_mask, history)
    offsets = torch.arange(K, device=device)
    label_pos = anchor[:, None] + 1 + offsets  # (N, K)
    last = length[:, None] - 1  # (N, 1)
    valid = (label_pos <= last) & real[:, None] & keep
    label_pos = torch.minimum(label_pos, last)
    prev_tokens = tokens[base[:, None] + torch.minimum(anchor[:, None] + offsets, last)]
    if head_rows is None:
        head_rows = draft_head_rows(drafter, target)
    teacher = teacher_at(padded.final_hidden.flatten(0, 1), padded.target_lse.view(-1),
                         padded.target_argmax.view(-1), head_rows, base[:, None] + label_pos - 1)
    return Batch(ctx, prev_tokens, tokens[base[:, None] + label_pos], teacher, valid, G)


def make_batch(drafter: NeuralDrafter, target: TargetModel, feats: SequenceFeatures, anchors: torch.Tensor,
               K: int, cod_generator: torch.Generator | None = None, head_rows: torch.Tensor | None = None) -> Batch:
    """Blocks at `anchors` (N,) of one sequence: `make_step_batch` of that sequence alone (one group)."""
    return make_step_batch(drafter, target, [feats], [anchors], K, [cod_generator], head_rows)


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
                 train_ids: Sequence[int], config: TrainConfig, rank: int = 0, world_size: int = 1,
                 load_sequences: Callable[[list[int]], list[SequenceFeatures]] | None = None) -> None:
        """`load_sequence(i)` gives sequence i's features; `load_sequences(ids)`, where given, those of several at
        once (`OnlineFeatures.load_many`: one target forward), which a step's and validation's batches take."""
        if not train_ids:
            raise ValueError("no training sequences")
        self.drafter, self.target, self.load_sequence = drafter, target, load_sequence
        self.load_sequences = load_sequences
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
        # Compiled on the first step (minutes on a CPU; inductor's disk cache keeps it for later processes).
        self._step_loss = torch.compile(self.step_loss) if config.compile else self.step_loss

    def load(self, seq: int) -> SequenceFeatures:
        """Sequence `seq`'s features on the drafter's device, with the teacher's summary."""
        return self.load_sequence(seq).to(self.device).with_teacher(self.target)

    def load_many(self, seqs: Sequence[int]) -> list[SequenceFeatures]:
        """`load` of each of `seqs`, through `load_sequences` where the trainer has it."""
        if self.load_sequences is None:
            return [self.load(seq) for seq in seqs]
        return [f.to(self.device).with_teacher(self.target) for f in self.load_sequences(list(seqs))]

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

        All the step's blocks run as one batch (`make_step_batch`): one backbone forward, one Markov
        head forward (so the dense (V, r) gradient of its embedding is built once a step), one loss that
        averages within each sequence and then over the sequences, one backward. The forward runs in the
        run's precision; the sum of the logits and the loss are fp32 whatever it is. A kind's own extra
        loss (DFlash-2's path selector) is taken over all the step's rows at once.
        """
        batch = self.step_batch(step)
        zeros = [0.0] * self.K
        if batch is None:
            return 0.0, zeros, zeros
        ctx = batch.ctx
        if self.config.compile:  # the context length changes from step to step: one graph for all of them
            for t in (ctx.context_mask, *(x for pair in ctx.context_kv for x in pair)):
                torch._dynamo.mark_dynamic(t, 1)
        total, ce, tv = self._step_loss(ctx.block_tokens, ctx.positions, ctx.last_hidden, list(ctx.context_kv),
                                        ctx.context_mask, ctx.history, batch.prev_tokens, batch.labels,
                                        batch.teacher.on_vocab, batch.valid, batch.groups)
        total.backward()  # one backward a step
        return float(total.detach()), ce.tolist(), tv.tolist()

    def step_loss(self, block_tokens: torch.Tensor, positions: torch.Tensor, last_hidden: torch.Tensor,
                  context_kv: list[tuple[torch.Tensor, torch.Tensor]], context_mask: torch.Tensor,
                  history: torch.Tensor | None, prev_tokens: torch.Tensor, labels: torch.Tensor,
                  on_vocab: torch.Tensor, valid: torch.Tensor, groups: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step batch's forward and loss, tensors in and out (what `TrainConfig.compile` compiles): the
        `Batch` fields, the context's as `BlockContext` takes them. Returns (loss, ce (K,), tv (K,))."""
        ctx = BlockContext(block_tokens, positions, last_hidden, context_kv, context_mask, history)
        with precision_context(self.precision, self.device):
            if self.drafter.sequential_head:
                # Slot k depends on the previous token through more than an additive Markov term
                # (DFly, DFlash-2, DeLS-Spec): such a kind teacher-forces its own head and may add a
                # loss of its own (DFlash-2's path-selector cross-entropy).
                logits, own_loss = self.drafter.training_logits(ctx, prev_tokens, labels, valid)  # (N, K, Vp)
                correction = None
            else:
                logits, own_loss = self.drafter.block_logits(ctx), None  # (N, K, Vp)
                correction = self.drafter.markov_logits(prev_tokens)  # (N, K, Vp) or None
        if correction is not None:
            logits = logits.float() + correction.float()
        parts = drafter_loss(logits, on_vocab, labels, self.drafter.head.draft_vocab_ids, valid, self.config.loss,
                             groups=groups)
        total = parts.loss if own_loss is None else parts.loss + own_loss.float()
        return total, parts.ce, parts.tv

    def step_batch(self, step: int) -> Batch | None:
        """This process's blocks of `step`, one group per sequence (None: no sequence has an anchor)."""
        chosen = self.sequences_for_step(step)
        feats, anchors, cod = self.load_many([seq for _, seq in chosen]), [], []
        for (slot, _), f in zip(chosen, feats):
            g = step_generator(self.config.seed, step, slot)
            anchors.append(sample_anchors(f, self.config.anchors_per_seq, g))
            cod.append(g if self.config.cod_keep else None)  # draws after the anchors, from the same source
        if not any(a.numel() for a in anchors):
            return None
        return make_step_batch(self.drafter, self.target, feats, anchors, self.K, cod, self.head_rows)

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
    def held_out_loss(self, val_ids: Sequence[int], anchors_per_seq: int = 32, seqs_per_forward: int = 8) -> float:
        """The recipe's loss (fp32, no COD) on fixed blocks of held-out sequences (the anchors `validate`
        uses), averaged within each sequence and then over the sequences, as a step's loss is: the loss
        per block that configurations trained on as many blocks compare by."""
        self.drafter.eval()
        losses = []
        for start in range(0, len(val_ids), seqs_per_forward):
            seqs = val_ids[start:start + seqs_per_forward]
            feats = self.load_many(seqs)
            anchors = [sample_anchors(f, anchors_per_seq, step_generator(self.config.seed, -1, seq))
                       for f, seq in zip(feats, seqs)]
            if not any(a.numel() for a in anchors):
                continue  # sequences without a block add 0, as in a training step
            batch = make_step_batch(self.drafter, self.target, feats, anchors, self.K, head_rows=self.head_rows)
            logits = self.drafter.teacher_forced_logits(batch.ctx, batch.prev_tokens)
            parts = drafter_loss(logits, batch.teacher.on_vocab, batch.labels, self.drafter.head.draft_vocab_ids,
                                 batch.valid, self.config.loss, groups=batch.groups)
            losses.append(float(parts.loss) * len(seqs))
        if not val_ids:
            raise ValueError("no held-out sequences")
        return sum(losses) / len(val_ids)

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
