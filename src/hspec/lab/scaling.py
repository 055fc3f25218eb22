"""`hspec lab scaling`: what more training compute buys (issue 54) — one recipe at several budgets of blocks.

Every budget is its own run from scratch, in its own run directory under `runs_dir` (outside the repository,
kept across sessions): the recipe is the shipped drafter's (its batch of 4 sequences x 16 anchors, AdamW at
6e-4, 1% warmup then half-cosine, the 0.1 CE + 0.9 TV loss, an 8,192-token draft vocabulary), and the schedule
ends at the run's own budget, so each point is a finished run of that budget rather than a checkpoint of a
longer one. A block is one anchor: K drafted positions under the loss.

Each finished run is measured twice, both greedy at the drafter's K, both in decode order (the anchors greedy
decoding itself visits, `Trainer.validate_in_decode_order`, whose tau equals measured MAL sequence by sequence:
results/decoding_vs_validation.md):
1. held out: the held-out split `hspec train` and `hspec validate` use (the first `val_sequences` 1-in-20 ids);
2. Spec-Bench: the target's own greedy responses to Spec-Bench prompts (a committed corpus of first turns
   outside `hspec eval`'s subset), the first `per_category` of each of its six categories.
Both keep each sequence's histogram of accepted counts, so the report resamples sequences for its intervals
(`lab/scaling_report.py`). The measurements are cached next to each run (`curve_eval.json`, keyed by the
drafter's digest and the sequences), so a rerun of the same command resumes: unfinished training resumes from
its saved state, finished runs are not trained or measured again. A reference drafter (the shipped one, which
has a longer and different history) is measured by the same code and shown apart from the curve.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hspec.data.tasks import load_task
from hspec.drafters import DRAFTERS
from hspec.drafters.checkpoint import checkpoint_digest, load_drafter
from hspec.drafters.common import NeuralDrafter, kv_layer_of, select_target_layers
from hspec.models.loading import Target, load_target
from hspec.training.datagen import read_corpus
from hspec.training.report import read_history, training_minutes
from hspec.training.run import held_out_ids, train
from hspec.training.store import FeatureStore, FeatureStores
from hspec.training.trainer import TrainConfig, Trainer

EVAL_FILE = "curve_eval.json"  # a run's (or the reference's) per-sequence measurements
SPEC_BENCH_FEATURES = "spec_bench_features"  # feature cache of the Spec-Bench responses, under runs_dir


@dataclass(frozen=True)
class Recipe:
    """The training recipe every budget runs; only the number of steps differs between runs."""

    kind: str = "hspec"  # drafter kind
    seqs_per_step: int = 4  # sequences per optimizer step (the shipped drafter's)
    anchors_per_seq: int = 16  # blocks drawn per sequence
    lr: float = 6e-4  # peak learning rate of the warmup + half-cosine schedule over the run's own steps
    draft_vocab: int = 8192  # Vp, the most frequent training tokens
    seed: int = 0
    precision: str = "auto"  # as `hspec train --precision`

    def __post_init__(self) -> None:
        if self.kind not in DRAFTERS or not issubclass(DRAFTERS.get(self.kind), NeuralDrafter):
            raise ValueError(f"kind must be a trained drafter kind, got {self.kind!r}")
        for name in ("seqs_per_step", "anchors_per_seq", "draft_vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def blocks_per_step(self) -> int:
        return self.seqs_per_step * self.anchors_per_seq

    def steps_for(self, blocks: int) -> int:
        """Optimizer steps of a run of `blocks` blocks (a whole number of steps, or ValueError)."""
        if blocks < self.blocks_per_step or blocks % self.blocks_per_step:
            raise ValueError(f"a budget must be a positive multiple of {self.blocks_per_step} blocks (one step of "
                             f"{self.seqs_per_step} x {self.anchors_per_seq}), got {blocks}")
        return blocks // self.blocks_per_step

    def config(self, blocks: int) -> TrainConfig:
        """The trainer's config of a run of `blocks` blocks."""
        return TrainConfig(steps=self.steps_for(blocks), lr=self.lr, seqs_per_step=self.seqs_per_step,
                           anchors_per_seq=self.anchors_per_seq, seed=self.seed, precision=self.precision,
                           cod_keep=DRAFTERS.get(self.kind).trains_with_cod)


@dataclass(frozen=True)
class CurvePlan:
    """What `run_curve` trains and measures."""

    recipe: Recipe
    budgets: tuple[int, ...]  # blocks of each run, ascending
    features: tuple[Path, ...]  # the training feature caches (their order fixes the held-out split)
    runs_dir: Path  # one run directory per budget, the Spec-Bench features and the reference's measurements
    spec_bench_corpus: Path  # the target's greedy responses to Spec-Bench prompts (`hspec data generate`)
    spec_bench_per_category: int = 16  # responses measured per Spec-Bench category
    val_sequences: int = 24  # held-out sequences measured
    reference: Path | None = None  # a drafter measured alongside, not part of the curve (e.g. the shipped one)
    reference_blocks: int | None = None  # the blocks the reference was trained on (shown on the x axis), if known
    target: str = "smollm2"
    save_minutes: float = 5.0  # the longest a run's unsaved training may be (a lost machine costs at most this)
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in the report's settings as they are

    def __post_init__(self) -> None:
        if not self.budgets or list(self.budgets) != sorted(set(self.budgets)):
            raise ValueError(f"budgets must be distinct and ascending, got {list(self.budgets)}")
        for blocks in self.budgets:
            self.recipe.steps_for(blocks)
        if self.spec_bench_per_category < 1 or self.val_sequences < 1:
            raise ValueError("spec_bench_per_category and val_sequences must be >= 1")

    def run_dir(self, blocks: int) -> Path:
        return self.runs_dir / f"{self.recipe.kind}_{blocks}"


@dataclass(frozen=True)
class SequenceSet:
    """Sequences a drafter is measured on: a feature source and the indices in it."""

    name: str  # "held_out" or "spec_bench"
    store: FeatureStore | FeatureStores
    indices: tuple[int, ...]

    @property
    def ids(self) -> list[str]:
        return [self.store.ids[i] for i in self.indices]


def spec_bench_subset(corpus: Path, per_category: int, data_dir: str | Path | None = None) -> list[dict]:
    """The first `per_category` responses of each Spec-Bench category in `corpus`, in item-number order.

    Records are `hspec data generate`'s (id "spec_bench/<n>", prompt_ids, response_ids); each gains its
    "category" from the Spec-Bench file. Ordered by category, then item number.
    """
    category_of = {item.id: item.category for item in load_task("spec_bench", None, data_dir).items}
    records = [r for r in read_corpus(corpus) if r.get("response_ids")]
    unknown = [r["id"] for r in records if r["id"] not in category_of]
    if unknown:
        raise ValueError(f"{corpus} holds responses to prompts that are not Spec-Bench items: {unknown[:3]}")
    chosen = []
    for category in sorted(set(category_of.values())):
        mine = sorted((r for r in records if category_of[r["id"]] == category),
                      key=lambda r: int(r["id"].rsplit("/", 1)[1]))
        chosen += [{**r, "category": category} for r in mine[:per_category]]
    return chosen


def sequence_sets(plan: CurvePlan, target: Target) -> list[SequenceSet]:
    """The held-out split of the training features and the Spec-Bench responses (their features made once)."""
    train_store = FeatureStores(list(plan.features))
    held_out = SequenceSet("held_out", train_store, tuple(held_out_ids(train_store, plan.val_sequences)))
    records = spec_bench_subset(plan.spec_bench_corpus, plan.spec_bench_per_category)
    layers = select_target_layers(target.config.num_layers)
    store = FeatureStore.build(plan.runs_dir / SPEC_BENCH_FEATURES, target.model, target.name, records, layers,
                               [kv_layer_of(layer) for layer in layers])
    return [held_out, SequenceSet("spec_bench", store, tuple(range(len(store.ids))))]


def accepted_histograms(trainer: Trainer, sequences: SequenceSet) -> dict[str, list[int]]:
    """Per sequence id, the histogram (K+1 counts) of accepted drafts over the steps greedy decoding takes.

    A sequence whose response is too short for one block of K is left out (as `validate_in_decode_order`
    leaves it out of its mean).
    """
    out = {}
    for i in sequences.indices:
        feats = sequences.store.load(i)
        if feats.tokens.shape[0] - 1 - trainer.K < feats.prompt_length:
            continue
        stats = trainer.validate_in_decode_order([i])
        out[sequences.store.ids[i]] = list(stats.accepted_count_histogram)
    return out


def measure(drafter_dir: Path, target: Target, sets: Sequence[SequenceSet], cache: Path) -> dict[str, Any]:
    """The drafter's per-sequence histograms on each set, from `cache` when it holds them for this very drafter
    (by digest) and these sequences; measured and written there otherwise."""
    digest = checkpoint_digest(drafter_dir)
    wanted = {s.name: s.ids for s in sets}
    if cache.exists():
        held = json.loads(cache.read_text())
        if held.get("digest") == digest and held.get("sequences") == wanted:
            return held
    drafter = load_drafter(drafter_dir, target.model)
    result: dict[str, Any] = {"drafter": str(drafter_dir), "digest": digest, "sequences": wanted}
    for s in sets:
        trainer = Trainer(drafter, target.model, s.store.load, list(s.indices), TrainConfig(steps=1))
        result["K"] = trainer.K
        result[s.name] = accepted_histograms(trainer, s)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, cache)
    return result


def finished_point(plan: CurvePlan, blocks: int) -> dict[str, Any] | None:
    """What the report shows of the run of `blocks` blocks: its training (from its history) and its measurements;
    None until the run has trained all its steps and been measured."""
    run_dir = plan.run_dir(blocks)
    cache = run_dir / EVAL_FILE
    if not cache.exists() or not (run_dir / "drafter" / "config.json").exists():
        return None
    run = read_history(run_dir)
    steps = plan.recipe.steps_for(blocks)
    if not run["steps"] or run["steps"][-1]["step"] + 1 < steps:
        return None
    last = run["steps"][-10:]  # the last ten logged steps' loss: the end of the schedule
    return {"blocks": blocks, "steps": steps, "run_dir": str(run_dir),
            "train_minutes": training_minutes(run), "final_loss": sum(s["loss"] for s in last) / len(last),
            "precision": run["config"].get("precision"), "train_sequences": run["config"].get("train_sequences"),
            "measured": json.loads(cache.read_text())}


# Called with each message of the curve's progress (the command prints it with a time stamp).
Progress = Callable[[str], None]


def run_curve(plan: CurvePlan, train_runs: bool = True, target: Target | None = None,
              progress: Progress = print) -> list[dict[str, Any]]:
    """Train (unless `train_runs` is False) and measure every budget in ascending order; returns the finished
    points. Resumable: rerun with the same plan after a kill."""
    if target is None:
        target = load_target(plan.target)
    sets = sequence_sets(plan, target)
    progress(f"measuring on {len(sets[0].indices)} held-out and {len(sets[1].indices)} Spec-Bench sequences")
    if plan.reference is not None:
        plan.runs_dir.mkdir(parents=True, exist_ok=True)
        measure(plan.reference, target, sets, plan.runs_dir / f"reference_{EVAL_FILE}")
        progress(f"reference {plan.reference} measured")
    points = []
    for blocks in plan.budgets:
        run_dir = plan.run_dir(blocks)
        if train_runs:
            progress(f"training {run_dir} ({plan.recipe.steps_for(blocks)} steps)")
            train(plan.recipe.kind, plan.target, list(plan.features), run_dir, plan.recipe.config(blocks),
                  val_every=plan.recipe.steps_for(blocks), val_sequences=0,
                  draft_vocab_size=plan.recipe.draft_vocab, target=target, save_minutes=plan.save_minutes)
        if (run_dir / "drafter" / "config.json").exists():
            measure(run_dir / "drafter", target, sets, run_dir / EVAL_FILE)
        point = finished_point(plan, blocks)
        if point is not None:
            points.append(point)
            progress(f"{run_dir} finished and measured")
    return points


def reference_point(plan: CurvePlan) -> dict[str, Any] | None:
    """The reference drafter's measurements, where `run_curve` made them."""
    cache = plan.runs_dir / f"reference_{EVAL_FILE}"
    if plan.reference is None or not cache.exists():
        return None
    return {"drafter": str(plan.reference), "blocks": plan.reference_blocks, "measured": json.loads(cache.read_text())}


def plan_settings(plan: CurvePlan) -> dict[str, Any]:
    """The plan as the report records it."""
    return {"target": plan.target, **asdict(plan.recipe), "budgets": list(plan.budgets),
            "features": [str(p) for p in plan.features], "runs_dir": str(plan.runs_dir),
            "spec_bench_corpus": str(plan.spec_bench_corpus), "spec_bench_per_category": plan.spec_bench_per_category,
            "val_sequences": plan.val_sequences, "reference": None if plan.reference is None else str(plan.reference),
            "reference_blocks": plan.reference_blocks,
            **plan.extra}
