"""fp32 against bf16-autocast training, interleaved in one run: steps/s and validation tau at the same step.

1. Two drafters of one kind start from the same initial weights (one seed) and the same draft vocabulary
   (the most frequent tokens of the training sequences), one trainer per precision, the same recipe.
2. They train in rounds of `round_steps` optimizer steps, alternating which precision goes first
   (A B, B A, ...), so that drift in the machine's load hits both alike; each round's steps/s ratio
   (bf16 / fp32) is taken between neighbours in time.
3. Both have drawn the same sequences and anchors at every step (the draws depend on (seed, step) only),
   so after the last round the two validations (uniform anchors and decode order, both in fp32, on the
   held-out split `hspec train` uses) compare the precisions at the same step count on the same data.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from hspec.drafters import create_drafter, drafter_config
from hspec.models.loading import Target
from hspec.training.features import SequenceFeatures
from hspec.training.precision import PRECISIONS
from hspec.training.trainer import TrainConfig, Trainer


def compare_precisions(target: Target, kind: str, load_sequence: Callable[[int], SequenceFeatures],
                       train_ids: list[int], val_ids: list[int], draft_vocab: torch.Tensor, config: TrainConfig,
                       round_steps: int = 10, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train `kind` in each of PRECISIONS for `config.steps` steps, interleaved (module docstring).

    draft_vocab: (Vp,) target ids of the pruned vocabulary. Returns the per-round timings and losses,
    steps/s per precision, the per-round ratios and both validations (JSON-ready).
    """
    if round_steps < 1 or config.steps % round_steps:
        raise ValueError(f"round_steps must be >= 1 and divide steps ({config.steps}), got {round_steps}")
    if not val_ids:
        raise ValueError("no held-out sequences to validate on")
    trainers = {}
    for precision in PRECISIONS:
        torch.manual_seed(config.seed)  # the same initial weights for both
        drafter = create_drafter(kind, target.config, target_model=target.model,
                                 config=drafter_config(kind, target.config, draft_vocab_size=draft_vocab.numel()))
        drafter.head.set_vocab(draft_vocab)
        trainers[precision] = Trainer(drafter, target.model, load_sequence, train_ids,
                                      replace(config, precision=precision))
    fp32, bf16 = (trainers[p].drafter.drafter_state_dict() for p in PRECISIONS)
    if any(not torch.equal(fp32[k], bf16[k]) for k in fp32):
        raise RuntimeError("the two drafters did not start from the same weights")

    rounds = []
    for r in range(config.steps // round_steps):
        order = PRECISIONS if r % 2 == 0 else PRECISIONS[::-1]
        row: dict[str, Any] = {"round": r, "order": list(order)}
        for precision in order:
            start = time.perf_counter()
            losses = [trainers[precision].train_step(step).loss
                      for step in range(r * round_steps, (r + 1) * round_steps)]
            seconds = time.perf_counter() - start
            row[precision] = {"seconds": seconds, "steps_per_s": round_steps / seconds,
                              "mean_loss": statistics.fmean(losses)}
        row["ratio"] = row["bf16-autocast"]["steps_per_s"] / row["fp32"]["steps_per_s"]
        log(f"round {r}: fp32 {row['fp32']['steps_per_s']:.3f} steps/s, bf16-autocast "
            f"{row['bf16-autocast']['steps_per_s']:.3f} steps/s (x{row['ratio']:.2f}), loss "
            f"{row['fp32']['mean_loss']:.4f} / {row['bf16-autocast']['mean_loss']:.4f}")
        rounds.append(row)

    summary: dict[str, Any] = {}
    for precision, trainer in trainers.items():
        seconds = sum(row[precision]["seconds"] for row in rounds)
        anchors, in_order = trainer.validate(val_ids), trainer.validate_in_decode_order(val_ids)
        summary[precision] = {"steps_per_s": config.steps / seconds, "seconds": seconds,
                              "final_round_loss": rounds[-1][precision]["mean_loss"],
                              "validation": anchors.to_dict(), "validation_decode_order": in_order.to_dict()}
        log(f"{precision}: validation tau {anchors.mean_accepted_length:.3f} "
            f"(decode order {in_order.mean_accepted_length:.3f})")
    ratios = [row["ratio"] for row in rounds]
    return {"rounds": rounds, "summary": summary,
            "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}
