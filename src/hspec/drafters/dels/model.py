"""The DeLS-Spec drafter: a frozen DFlash drafter fused with a local GRU head (config.py has the
equations and what hspec chose where the sources are silent).

Forward over a block [x0, MASK x (K-1)] at positions p..p+K-1:
1. the DFlash backbone (its context K/V in the pool's drafter layers, written by `commit`) gives
   l_dflash (N, K, Vp), as the `dflash` kind does; its weights are frozen in training;
2. the GRU reads the target's embeddings of the W tokens before x0 (zeros before the sequence start),
   then prev_k = x0, d_1, ..., d_{K-1} one slot at a time; its output after prev_k gives
   l_local,k = U_r(D_r g_k) (N, Vp);
3. l_k = l_dflash,k + alpha l_local,k - beta l_prior, then the target's sampling transform.

Loading a trained `dflash` checkpoint's weights into the DFlash part: `load_dflash_weights`.

Legend: N rows, K block, W local window, H hidden, Hg GRU width, r rank, Vp pruned vocab.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hspec.drafters.base import DRAFTERS, DraftBatch, Proposal
from hspec.drafters.common import BlockContext, NeuralDrafter
from hspec.drafters.dels.config import DeLSConfig
from hspec.drafters.dflash.model import DFlashDrafter
from hspec.drafters.sequential import inference_context, sample_slots
from hspec.models.config import TargetConfig
from hspec.models.formats.base import StoredWeight
from hspec.models.formats.int8 import int8_kernel_fits
from hspec.models.formats.store import int8_weight


class LocalHead(nn.Module):
    """GRU over token embeddings, then Hg -> r -> Vp. The last projection starts at zero (l_local = 0).

    Drafting reads the GRU's weights once a step, 16 + K steps a block one after another (docs/drafters.md,
    dels): `store_int8` keeps int8 copies of its gate matrices and of U_r, which inference then multiplies
    in a recurrence of its own (nn.GRU's equations) at half the bytes; training keeps nn.GRU.
    """

    def __init__(self, hidden: int, local_hidden: int, rank: int, draft_vocab_size: int) -> None:
        super().__init__()
        self.gru = nn.GRU(hidden, local_hidden, batch_first=True)
        self.down = nn.Linear(local_hidden, rank, bias=False)
        self.up = nn.Parameter(torch.zeros(rank, draft_vocab_size))  # (r, Vp), stored as the Markov head's W2
        self._int8: dict[str, StoredWeight] = {}  # set by store_int8

    def store_int8(self, compute_dtype: torch.dtype, kernel: str) -> None:
        """Draft with int8 rows (one scale per row) of W_ih (3Hg, H), W_hh (3Hg, Hg) and U_r^T (Vp, r);
        the floating weights are kept. Nothing is stored where the int8 kernel cannot take a width."""
        kernel = "w8a8" if kernel == "w4a8" else kernel  # its recurrence multiplies int8 rows only
        weights = {"ih": self.gru.weight_ih_l0, "hh": self.gru.weight_hh_l0, "up": self.up.t()}
        if all(int8_kernel_fits(w) for w in weights.values()):
            self._int8 = {name: int8_weight(w.detach(), compute_dtype, kernel) for name, w in weights.items()}

    def forward(self, embeddings: torch.Tensor, state: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeddings (N, T, H), state (1, N, Hg) or None -> logits (N, T, Vp) and the new state."""
        if self._int8 and not self.up.requires_grad and embeddings.dtype == self._int8["up"].scale.dtype:
            out, state = self._recurrence_int8(embeddings, state)
            return self._int8["up"](self.down(out)), state
        out, state = self.gru(embeddings, state)  # (N, T, Hg), (1, N, Hg)
        return self.down(out) @ self.up, state

    def _recurrence_int8(self, embeddings: torch.Tensor, state: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """nn.GRU's recurrence with the int8 gate matrices: the input gates of all T steps in one product,
        then per step h W_hh^T (gates r, z, n in that order, as nn.GRU stacks them).
        embeddings (N, T, H), state (1, N, Hg) or None -> outputs (N, T, Hg) and the last state (1, N, Hg)."""
        n, steps, _ = embeddings.shape
        gru = self.gru
        gates_x = self._int8["ih"](embeddings, gru.bias_ih_l0)  # (N, T, 3Hg)
        hidden_gates = self._int8["hh"]
        h = (embeddings.new_zeros(n, gru.hidden_size) if state is None else state[0])  # (N, Hg)
        outputs = []
        for t in range(steps):
            r_x, z_x, n_x = gates_x[:, t].chunk(3, dim=-1)  # (N, Hg) each
            r_h, z_h, n_h = hidden_gates(h, gru.bias_hh_l0).chunk(3, dim=-1)
            r, z = torch.sigmoid(r_x + r_h), torch.sigmoid(z_x + z_h)
            candidate = torch.tanh(n_x + r * n_h)
            h = candidate + z * (h - candidate)  # (1 - z) n + z h
            outputs.append(h)
        return torch.stack(outputs, dim=1), h[None]


@DRAFTERS.register("dels")
class DeLSDrafter(DFlashDrafter):
    """DeLS-Spec: DFlash (frozen) + the local GRU head, fused with a unigram prior."""

    config_class = DeLSConfig
    config: DeLSConfig
    sequential_head = True  # the trainer calls `training_logits` (the GRU needs the previous tokens)
    starts_from = ("dflash",)

    def __init__(self, target_config: TargetConfig, target_model: nn.Module | None = None,
                 config: DeLSConfig | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(target_config, target_model, config, device, dtype)
        self.history_window = self.config.local_window  # the trainer builds `BlockContext.history` from it
        if self.config.freeze_dflash:
            for name, p in self.named_parameters():
                p.requires_grad_(name.startswith("local."))

    def build(self) -> None:
        super().build()  # the DFlash drafter
        c = self.config
        self.local = LocalHead(c.hidden_size, c.local_hidden, c.local_rank, c.draft_vocab_size)
        # l_prior over the draft vocabulary, saved with the drafter; uniform (no effect) until set.
        self.register_buffer("log_prior", torch.zeros(c.draft_vocab_size))

    def store_int8(self, compute_dtype: torch.dtype, kernel: str) -> None:
        """DFlash's int8 copies and the local head's (`LocalHead.store_int8`)."""
        super().store_int8(compute_dtype, kernel)
        self.local.store_int8(compute_dtype, kernel)

    def set_log_prior(self, counts: torch.Tensor) -> None:
        """l_prior = log of the add-one unigram frequencies of the draft vocabulary; counts (V,) per target id."""
        counts = torch.as_tensor(counts, dtype=torch.float64)
        if counts.shape != (self.config.vocab_size,):
            raise ValueError(f"counts must be ({self.config.vocab_size},) per target id, got {tuple(counts.shape)}")
        local = counts[self.head.draft_vocab_ids.cpu()] + 1.0
        self.log_prior.copy_((local / local.sum()).log().to(self.log_prior.dtype))

    @classmethod
    def from_dflash(cls, dflash: DFlashDrafter, target_model: nn.Module, **overrides) -> DeLSDrafter:
        """A DeLS-Spec drafter around a trained `dflash` drafter (its sizes, vocabulary and weights)."""
        if dflash.kind != "dflash":
            raise ValueError(f"DeLS-Spec fuses a 'dflash' drafter, got kind {dflash.kind!r}")
        c = dflash.config
        config = DeLSConfig.from_target("dels", c.target, target_layers=c.target_layers,
                                        draft_vocab_size=c.draft_vocab_size, max_draft_len=c.max_draft_len,
                                        sliding_window=c.sliding_window, num_layers=c.num_layers, **overrides)
        weight = dflash.mask_embedding
        drafter = cls(c.target, target_model, config=config, device=weight.device, dtype=weight.dtype)
        drafter.load_dflash_weights(dflash.state_dict())
        return drafter

    @classmethod
    def start_from(cls, trained: NeuralDrafter, target_model: nn.Module) -> DeLSDrafter:
        return cls.from_dflash(trained, target_model)  # type: ignore[arg-type]

    def load_dflash_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Take a `dflash` drafter's state dict (weights and draft vocabulary) as the DFlash part."""
        own = self.state_dict()
        unknown = sorted(set(state) - set(own))
        missing = sorted(k for k in own if k not in state and not k.startswith("local.") and k != "log_prior")
        if unknown or missing:
            raise ValueError(f"not a dflash drafter's state for this DeLS drafter: unknown {unknown}, "
                             f"missing {missing}")
        self.load_state_dict(state, strict=False)

    # ---- forward -----------------------------------------------------------------------------------

    def embed_history(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N, T) target ids, -1 = before the sequence start -> (N, T, H), zeros for -1."""
        emb = F.embedding(tokens.clamp(min=0), self.target_parts.embed_weight)  # (N, T, H)
        return emb * (tokens >= 0)[..., None].to(emb.dtype)

    def fuse(self, dflash_logits: torch.Tensor, local_logits: torch.Tensor) -> torch.Tensor:
        """l = l_dflash + alpha l_local - beta l_prior, any leading shape (..., Vp)."""
        c = self.config
        return dflash_logits + c.fusion_alpha * local_logits - c.fusion_beta * self.log_prior.to(dflash_logits.dtype)

    def local_logits(self, history: torch.Tensor | None, prev_tokens: torch.Tensor) -> torch.Tensor:
        """l_local (N, K, Vp) teacher-forced: the GRU over [history (N, W) ; prev_tokens (N, K)]."""
        if self.config.local_window and (history is None or history.shape[1] != self.config.local_window):
            raise ValueError(f"dels reads the {self.config.local_window} tokens before x0; got history "
                             f"{None if history is None else tuple(history.shape)}")
        tokens = prev_tokens if not self.config.local_window else torch.cat([history, prev_tokens], 1)  # (N, W+K)
        logits, _ = self.local(self.embed_history(tokens).to(self.local.up.dtype))
        return logits[:, -prev_tokens.shape[1]:]

    def teacher_forced_logits(self, ctx: BlockContext, prev_tokens: torch.Tensor) -> torch.Tensor:
        """(N, K, Vp) fused logits with prev = [x0, x_{p+1}, ..., x_{p+K-1}] (N, K)."""
        return self.fuse(self.block_logits(ctx), self.local_logits(ctx.history, prev_tokens))

    def training_logits(self, ctx: BlockContext, prev_tokens: torch.Tensor, labels: torch.Tensor,
                        valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeLS-Spec's recipe: next-token prediction on the local head alone.

        Returns the fused logits detached (the trainer's unified loss then only reports how the fused
        drafter matches the target) and the local head's cross-entropy to the next token, averaged over
        valid slots whose label lies in the draft vocabulary.
        """
        local = self.local_logits(ctx.history, prev_tokens)  # (N, K, Vp)
        with torch.no_grad():
            fused = self.fuse(self.block_logits(ctx), local)
        vp = local.shape[-1]
        to_local = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=local.device)
        to_local[self.head.draft_vocab_ids] = torch.arange(vp, device=local.device)
        gold = to_local[labels]  # (N, K)
        counted = valid & (gold >= 0)
        ce = F.cross_entropy(local.float().flatten(0, 1), gold.clamp(min=0).flatten(), reduction="none")
        return fused, (ce * counted.flatten()).sum() / counted.sum().clamp(min=1)

    def history_of(self, tokens: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor | None:
        """(B, W) the W tokens before each row's x0 (its history ends with x0), -1 padded on the left."""
        w = self.config.local_window
        if not w:
            return None
        rows = [list(t[-w - 1:-1]) for t in tokens]
        return torch.tensor([[-1] * (w - len(r)) + r for r in rows], dtype=torch.long, device=device)

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        """One DFlash forward, the GRU over the history, then fusion and the draw slot by slot."""
        device = batch.anchor_tokens.device
        ctx = dataclasses.replace(inference_context(self, batch, K), history=self.history_of(batch.tokens, device))
        dflash_logits = self.block_logits(ctx)  # (B, K, Vp)
        state = None
        if ctx.history is not None:
            _, state = self.local(self.embed_history(ctx.history).to(self.local.up.dtype))
        carried = [state]

        def slot_logits(k: int, prev: torch.Tensor) -> torch.Tensor:
            local, carried[0] = self.local(self.embed_history(prev[:, None]).to(self.local.up.dtype), carried[0])
            return self.fuse(dflash_logits[:, k], local[:, 0])  # (B, Vp)

        local, probs, confidence = sample_slots(slot_logits, K, batch.anchor_tokens, self.head.to_target_ids,
                                                batch.sampling, batch.generators)
        return Proposal(self.head.to_target_ids(local), self.head.to_full(probs), confidence=confidence)
