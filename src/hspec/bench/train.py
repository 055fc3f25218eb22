"""`hspec bench train`: the trainer's throughput in blocks per second, and the loss per block it buys.

1. Configurations are the product of the axes (sequences per step, anchors per sequence, precision, peak
   learning rate, compiled step or not). Each trains a fresh drafter of one kind from the same initial weights and draft
   vocabulary (the most frequent tokens of the training sequences), with the recipe's schedule over the
   same number of blocks (steps = blocks / blocks per step), so configurations differ in how the blocks
   are batched, never in how many they see.
2. They train in interleaved rounds: in each round every configuration trains `round_blocks` blocks, in an
   order that alternates (as given, then reversed), so drift in the machine's load hits all of them alike.
   Round 0 is the warm-up (first-use costs: kernel choice, allocation, compilation) and is not timed.
3. After the last round, each configuration's loss per block on held-out sequences (the recipe's loss, in
   fp32, on fixed blocks: `Trainer.held_out_loss`) and its validation tau (`Trainer.validate`), at the same
   number of blocks trained.

Features are read once and kept on the training device (a GPU's memory included), so steps time the
trainer, not the feature files. The device is the target's: `--device auto` trains on a CUDA GPU when one
is visible, so the same command measures a GPU. Results: <out>/<name>.{json,md} with provenance.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hspec.drafters import create_drafter, drafter_config
from hspec.models.loading import Target, load_target, resolve_device
from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.training.features import SequenceFeatures
from hspec.training.memory import retain_freed_memory
from hspec.training.run import _draft_vocabulary, build_features, held_out_ids, is_validation
from hspec.training.store import FeatureStores
from hspec.training.trainer import TrainConfig, Trainer


@dataclass(frozen=True)
class BenchConfig:
    """One configuration of the trainer: how a step batches its blocks, and its arithmetic."""

    seqs_per_step: int
    anchors_per_seq: int
    precision: str  # fp32 | bf16-autocast
    lr: float  # peak learning rate
    compile: bool = False  # the step's forward and loss through torch.compile (`TrainConfig.compile`)

    @property
    def blocks_per_step(self) -> int:
        return self.seqs_per_step * self.anchors_per_seq

    @property
    def label(self) -> str:
        """'16x16 bf16-autocast lr 6e-04 compiled': sequences x anchors per step, precision, peak learning
        rate, and whether the step is compiled."""
        compiled = " compiled" if self.compile else ""
        return f"{self.seqs_per_step}x{self.anchors_per_seq} {self.precision} lr {self.lr:g}{compiled}"


def bench_configs(seqs_per_step: Sequence[int], anchors_per_seq: Sequence[int], precisions: Sequence[str],
                  lrs: Sequence[float], compile_step: Sequence[bool] = (False,)) -> list[BenchConfig]:
    """Every combination of the axes, in the order given (the first varies slowest)."""
    return [BenchConfig(*c) for c in itertools.product(seqs_per_step, anchors_per_seq, precisions, lrs, compile_step)]


def round_blocks_for(configs: Sequence[BenchConfig]) -> int:
    """The fewest blocks a round can hold: a whole number of steps of every configuration."""
    return math.lcm(*(c.blocks_per_step for c in configs))


def compare_configs(target: Target, kind: str, load_sequence: Callable[[int], SequenceFeatures],
                    train_ids: list[int], val_ids: list[int], draft_vocab: torch.Tensor,
                    configs: Sequence[BenchConfig], blocks: int, round_blocks: int, seed: int = 0,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train every configuration on `blocks` blocks in interleaved rounds (module docstring).

    draft_vocab: (Vp,) target ids of the pruned vocabulary. Returns, JSON-ready, the rounds (seconds,
    steps and mean training loss per configuration) and per configuration its throughput over the timed
    rounds, its held-out loss and its validation.
    """
    if not configs:
        raise ValueError("no configuration to benchmark")
    for c in configs:
        if round_blocks % c.blocks_per_step:
            raise ValueError(f"round_blocks {round_blocks} is not a whole number of {c.label}'s steps "
                             f"({c.blocks_per_step} blocks); use a multiple of {round_blocks_for(configs)}")
    if blocks % round_blocks or blocks // round_blocks < 2:
        raise ValueError(f"blocks ({blocks}) must be at least two rounds of {round_blocks} blocks, a whole number")
    if not val_ids:
        raise ValueError("no held-out sequences to validate on")
    device = target.model.embed_tokens.weight.device
    trainers = []
    for c in configs:
        torch.manual_seed(seed)  # the same initial weights for all
        drafter = create_drafter(kind, target.config, target_model=target.model,
                                 config=drafter_config(kind, target.config, draft_vocab_size=draft_vocab.numel()))
        drafter.head.set_vocab(draft_vocab)
        drafter.to(device)
        recipe = TrainConfig(steps=blocks // c.blocks_per_step, lr=c.lr, seqs_per_step=c.seqs_per_step,
                             anchors_per_seq=c.anchors_per_seq, seed=seed, precision=c.precision, compile=c.compile)
        trainers.append(Trainer(drafter, target.model, load_sequence, train_ids, recipe))

    rounds = []
    for r in range(blocks // round_blocks):
        order = list(range(len(configs))) if r % 2 == 0 else list(range(len(configs)))[::-1]
        row: dict[str, Any] = {"round": r, "blocks_after": (r + 1) * round_blocks, "timed": r > 0,
                               "order": [configs[i].label for i in order], "configs": {}}
        for i in order:
            steps = round_blocks // configs[i].blocks_per_step
            _synchronize(device)
            start = time.perf_counter()
            losses = [trainers[i].train_step(step).loss for step in range(r * steps, (r + 1) * steps)]
            _synchronize(device)
            seconds = time.perf_counter() - start
            row["configs"][configs[i].label] = {"seconds": seconds, "steps": steps,
                                                "blocks_per_s": round_blocks / seconds,
                                                "mean_loss": statistics.fmean(losses)}
        timings = [f"{label} {v['blocks_per_s']:.1f} blocks/s loss {v['mean_loss']:.4f}"
                   for label, v in row["configs"].items()]
        log(f"round {r}{'' if r else ' (warm-up)'}: " + ", ".join(timings))
        rounds.append(row)

    first = configs[0].label
    results = []
    for c, trainer in zip(configs, trainers):
        timed = [row["configs"][c.label] for row in rounds if row["timed"]]
        seconds, steps = sum(t["seconds"] for t in timed), sum(t["steps"] for t in timed)
        ratios = [row["configs"][c.label]["blocks_per_s"] / row["configs"][first]["blocks_per_s"]
                  for row in rounds if row["timed"]]
        held_out = trainer.held_out_loss(val_ids)
        validation = trainer.validate(val_ids)
        log(f"{c.label}: {steps * c.blocks_per_step / seconds:.1f} blocks/s, held-out loss {held_out:.4f}, "
            f"validation tau {validation.mean_accepted_length:.3f}")
        results.append({**asdict(c), "label": c.label, "blocks_per_step": c.blocks_per_step,
                        "steps": trainer.config.steps, "timed_steps": steps, "timed_seconds": seconds,
                        "blocks_per_s": steps * c.blocks_per_step / seconds, "ms_per_step": 1000 * seconds / steps,
                        "ratio_to_first": {"median": statistics.median(ratios), "min": min(ratios),
                                           "max": max(ratios)},
                        "final_round_loss": rounds[-1]["configs"][c.label]["mean_loss"],
                        "held_out_loss": held_out, "validation": validation.to_dict()})
    return {"rounds": rounds, "configs": results}


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA step returns before its kernels finish)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_train_bench(target_name: str, kind: str, features_dirs: Sequence[Path], corpus: Path | None,
                    configs: Sequence[BenchConfig], blocks: int, round_blocks: int | None, out_dir: Path, name: str,
                    command: str, draft_vocab_size: int = 8192, val_sequences: int = 8, seed: int = 0,
                    device: str = "auto", retain_memory: bool = True) -> tuple[Path, Path]:
    """`hspec bench train`: features (built from `corpus` when `features_dirs[0]` has none yet), then
    `compare_configs`; writes <out_dir>/<name>.{json,md}. `retain_memory`: `training.memory.retain_freed_memory`
    first, as `hspec train` does."""
    where = resolve_device(device)
    retained = retain_freed_memory() if retain_memory and where.type == "cpu" else False
    if not (Path(features_dirs[0]) / "index.json").exists():
        if corpus is None:
            raise ValueError(f"no feature cache at {features_dirs[0]} and no --corpus to build it from")
        build_features(target_name, corpus, Path(features_dirs[0]), device=str(where))
    target = load_target(target_name, device=where)
    store = FeatureStores([Path(d) for d in features_dirs])
    train_ids = [i for i in store.available() if not is_validation(store.ids[i])]
    val_ids = held_out_ids(store, val_sequences)
    vocab = _draft_vocabulary(store, train_ids, target.config.vocab_size, draft_vocab_size).to(where)

    @functools.cache
    def on_device(i: int) -> SequenceFeatures:  # each sequence read once, then kept where training runs
        return store.load(i).to(where).with_teacher(target.model)

    round_blocks = round_blocks or round_blocks_for(configs)
    load_before = os.getloadavg()
    result = compare_configs(target, kind, on_device, train_ids, val_ids, vocab, configs, blocks, round_blocks, seed)
    settings = {"target": target.name, "kind": kind, "draft_vocab_size": draft_vocab_size,
                "features": ",".join(str(d) for d in features_dirs), "train_sequences": len(train_ids),
                "val_sequences": len(val_ids), "blocks": blocks, "round_blocks": round_blocks, "seed": seed,
                "device": str(where), "threads": torch.get_num_threads(), "retained_freed_memory": retained,
                "load_average_before": [round(x, 2) for x in load_before],
                "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    payload = {"provenance": provenance(command, settings), **result}
    return write_results(out_dir, name, payload, markdown(payload))


def markdown(payload: dict[str, Any]) -> str:
    """The results as a page: throughput and loss per configuration, then the loss curve by round."""
    s, configs = payload["provenance"]["settings"], payload["configs"]
    lines = ["# Trainer throughput: blocks per second and loss per block\n", provenance_markdown(payload["provenance"]),
             f"\n{s['kind']} (Vp {s['draft_vocab_size']}) on {s['device']}, {s['threads']} torch thread(s), "
             f"{s['blocks']} blocks per configuration from the same initial weights, interleaved in rounds of "
             f"{s['round_blocks']} blocks (order alternating; round 0 is the warm-up, not timed). Load average "
             f"(1, 5, 15 min) {s['load_average_before']} before, {s['load_average_after']} after. Held-out loss: "
             f"the recipe's loss in fp32 on 32 fixed blocks of each of {s['val_sequences']} held-out sequences; "
             f"tau: `Trainer.validate` on the same sequences.\n",
             "| configuration | blocks/step | steps | blocks/s | ms/step | x first (median, min-max by round) | "
             "last-round train loss | held-out loss | validation tau |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in configs:
        r = c["ratio_to_first"]
        lines.append(f"| {c['label']} | {c['blocks_per_step']} | {c['steps']} | {c['blocks_per_s']:.1f} | "
                     f"{c['ms_per_step']:.0f} | {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) | "
                     f"{c['final_round_loss']:.4f} | {c['held_out_loss']:.4f} | "
                     f"{c['validation']['mean_accepted_length']:.3f} |")
    labels = [c["label"] for c in configs]
    lines += ["", "Training loss by round (mean of the round's steps), against blocks trained:", "",
              "| blocks | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for row in payload["rounds"]:
        lines.append(f"| {row['blocks_after']} | " + " | ".join(f"{row['configs'][label]['mean_loss']:.4f}"
                                                                for label in labels) + " |")
    return "\n".join(lines) + "\n"
