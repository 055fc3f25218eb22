"""`hspec train`: features → vocabulary → drafter → the recipe, with resumable checkpoints.

Layout of a run directory:
    run_dir/state/          latest training state (weights + optimizer + step), written atomically
    run_dir/history.jsonl   one line per logged step / validation (`training.history`: fsynced appends,
                            atomic rewrites, a torn last line dropped)
    run_dir/drafter/        the final drafter in the Speculators format (config.json + model.safetensors)
Rerunning the same command resumes from `state/` and continues exactly where it stopped. A rerun with
other settings (another --steps, --lr, ...) is refused with the list of what changed, unless `override`
(`--override`) is given; the change is then recorded in history.jsonl. Temporary folders that a kill
during a save left behind are removed (or, for a replaced checkpoint, restored) on start.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from hspec.drafters import DRAFTERS, create_drafter, drafter_config
from hspec.drafters.checkpoint import load_drafter, read_checkpoint, save_drafter
from hspec.drafters.common import NeuralDrafter, kv_layer_of, select_target_layers
from hspec.durable import remove_stale_temporaries
from hspec.models.loading import Target, load_target, resolve_device
from hspec.training.checkpoint import load_training_state, save_training_state, training_states
from hspec.training.datagen import read_corpus
from hspec.training.features import OnlineFeatures
from hspec.training.history import append_record, read_records, trim_records, write_records
from hspec.training.precision import resolve_precision
from hspec.training.stop import StopRequest
from hspec.training.store import FeatureStore, FeatureStores
from hspec.training.trainer import TrainConfig, Trainer
from hspec.training.vocab import most_frequent_tokens


def is_validation(record_id: str, every: int = 20) -> bool:
    """A fixed 1-in-`every` split by id hash, independent of corpus order and size."""
    return zlib.crc32(record_id.encode()) % every == 0


def held_out_ids(store: FeatureStores, count: int) -> list[int]:
    """The first `count` held-out sequences of `store` (in its order): the ones every validation uses."""
    return [i for i in store.available() if is_validation(store.ids[i])][:count]


def build_features(target_name: str, corpus_path: Path, out_dir: Path, max_sequences: int | None = None,
                   device: str = "cpu", target: Target | None = None) -> Path:
    """`hspec data features`: cache the target features every drafter kind needs (5 selected layers).

    `target`: the target `target_name` names, already loaded on `device`; None loads it.
    """
    if target is None:
        target = load_target(target_name, device=resolve_device(device))
    records = [r for r in read_corpus(corpus_path) if r["response_ids"]]
    records.sort(key=lambda r: r["id"])
    if max_sequences is not None:
        records = records[:max_sequences]
    layers = select_target_layers(target.config.num_layers)
    kv_layers = [kv_layer_of(layer) for layer in layers]
    FeatureStore.build(out_dir, target.model, target.name, records, layers, kv_layers)
    return out_dir


@dataclass
class TrainingRun:
    """A run set up to take its steps (`set_up_run`): what the step loop and the final save read."""

    kind: str
    run_dir: Path
    config: TrainConfig  # its precision resolved
    target: Target
    drafter: NeuralDrafter
    trainer: Trainer
    val_ids: list[int]  # held-out sequences, validated on every `val_every` steps
    start: int  # the first step to take: 0, or the step its saved state resumes at
    rank: int  # this process's rank among `world` (data-parallel under torchrun)
    world: int

    @property
    def history(self) -> Path:
        return self.run_dir / "history.jsonl"


# Called after each step's update with the steps done so far, before the step is logged, validated or saved:
# a caller's progress display, or a test's signal arriving during the step.
StepHook = Callable[[int], None]


def train(kind: str, target_name: str, features_dirs: list[Path], run_dir: Path, config: TrainConfig,
          log_every: int = 10, val_every: int = 100, val_sequences: int = 24,
          draft_vocab_size: int | None = None, init_from: Path | None = None,
          corpora: list[Path] | None = None, device: str = "cpu", override: bool = False,
          target: Target | None = None, save_minutes: float = 10.0,
          drafter_options: dict[str, Any] | None = None, cpu_flags: frozenset[str] | None = None,
          on_step: StepHook | None = None) -> Path:
    """Train `kind` on the cached features; resumable; returns the saved drafter directory.

    Three stages: `set_up_run` (the resume check, the target, features, drafter and trainer), `take_steps`
    (the recipe's steps, logged, validated and saved) and `save_run` (the final drafter).
    `corpora` (generated JSONL files) replaces `features_dirs`: the target then computes each
    sequence's features when a step needs them (`OnlineFeatures`), which on a GPU beats a cache.
    `device` is where the target, the drafter and the features live ('auto', 'cpu', 'cuda', 'cuda:N').
    `draft_vocab_size` (Vp) overrides the kind's default pruned vocabulary (the paper's 32,000).
    `init_from` starts from a saved drafter of the same kind instead of a fresh one (fine-tuning on more
    data): its config and draft vocabulary are kept, and the recipe's schedule starts over.
    `drafter_options` overrides fields of a fresh drafter's config (`--drafter-option`,
    `drafters.base.parse_config_options`); a drafter from `init_from` keeps its own, so both raise.
    Resuming `run_dir` with settings other than the recorded ones raises ValueError listing them, unless
    `override` is True (the change is then logged in the history and the new settings apply).
    `config.precision` 'auto' resolves for `device` and the CPU's feature flags `cpu_flags` (default: this
    machine's; training/precision.py), or on a resume to the precision the run recorded, so that moving a
    run to other hardware does not switch it.
    `target` is the target `target_name` names, already loaded on `device`; None loads it (after the
    resume check, so a refused rerun loads nothing).
    The training state is saved at every validation, on SIGINT/SIGTERM, and once `save_minutes` have
    passed since the last save, so a machine lost without a signal costs at most that much training.
    `on_step` is called after every step (`StepHook`).
    """
    if save_minutes < 0:
        raise ValueError(f"save_minutes must be >= 0, got {save_minutes}")
    run = set_up_run(kind, target_name, features_dirs, run_dir, config, val_every, val_sequences, draft_vocab_size,
                     init_from, corpora, device, override, target, drafter_options, cpu_flags)
    if run is None:  # a rerun of a finished run writes nothing
        return run_dir / "drafter"
    take_steps(run, log_every, val_every, save_minutes, on_step)
    return save_run(run)


def set_up_run(kind: str, target_name: str, features_dirs: list[Path], run_dir: Path, config: TrainConfig,
               val_every: int = 100, val_sequences: int = 24, draft_vocab_size: int | None = None,
               init_from: Path | None = None, corpora: list[Path] | None = None, device: str = "cpu",
               override: bool = False, target: Target | None = None,
               drafter_options: dict[str, Any] | None = None,
               cpu_flags: frozenset[str] | None = None) -> TrainingRun | None:
    """The run `train` takes its steps in (its arguments are `train`'s), resumed from `run_dir/state` when
    there is one; None when `run_dir` already holds the finished run."""
    drafter_options = dict(drafter_options or {})
    if drafter_options and init_from is not None:
        raise ValueError(f"--drafter-option {sorted(drafter_options)} sets a fresh drafter's config; --init-from "
                         f"{init_from} keeps the saved drafter's own")
    where = resolve_device(device)
    rank, world = _init_distributed(where)
    history = run_dir / "history.jsonl"
    if config.precision == "auto":
        recorded = recorded_settings(history) if (run_dir / "state").exists() else None
        config = replace(config, precision=(recorded or {}).get("precision")
                         or resolve_precision("auto", where, cpu_flags))
    features = "online: " + ",".join(map(str, corpora)) if corpora else ",".join(map(str, features_dirs))
    settings = run_settings(kind, target_name, features, config, draft_vocab_size, init_from, val_every,
                            val_sequences, world, drafter_options)
    if rank == 0:
        for line in remove_stale_temporaries(run_dir) + remove_stale_temporaries(run_dir / "state"):
            print(f"[train] {line}", flush=True)
    if world > 1:
        dist.barrier()  # no rank reads the state while rank 0 tidies it
    changes = resume_changes(history, settings) if (run_dir / "state").exists() else {}
    if changes and not override:
        raise ValueError(f"{run_dir} holds a run made with other settings; changed: {_describe(changes)}. Rerun "
                         f"with the recorded settings to resume, pass --override to continue with the new ones "
                         f"(recorded in {history}), or train into another --out")
    if world == 1 and not changes and _finished(run_dir, config.steps):
        print(f"[train] {run_dir} has finished its {config.steps} steps; its drafter is {run_dir / 'drafter'}",
              flush=True)
        return None
    torch.manual_seed(config.seed)
    if target is None:
        target = load_target(target_name, device=where)
    store = _feature_source(target, features_dirs, corpora)
    available = store.available()
    train_ids = [i for i in available if not is_validation(store.ids[i])]
    val_ids = held_out_ids(store, val_sequences)
    if init_from is not None:
        drafter = _initial_drafter(init_from, kind, target.model, draft_vocab_size)
    else:
        overrides = {**drafter_options, **({} if draft_vocab_size is None else {"draft_vocab_size": draft_vocab_size})}
        config_override = drafter_config(kind, target.config, **overrides) if overrides else None
        drafter = create_drafter(kind, target.config, target_model=target.model, config=config_override)
        drafter.head.set_vocab(_draft_vocabulary(store, train_ids, target.config.vocab_size,
                                                 drafter.config.draft_vocab_size))
        drafter.to(where)
    if hasattr(drafter, "set_log_prior"):  # DeLS-Spec's l_prior: unigram frequencies of the training tokens
        drafter.set_log_prior(_token_counts(store, train_ids, target.config.vocab_size))
    trainer = Trainer(drafter, target.model, store.load, train_ids, config, rank, world,
                      load_sequences=store.load_many if isinstance(store, OnlineFeatures) else None)
    run_dir.mkdir(parents=True, exist_ok=True)
    start = 0
    if (run_dir / "state").exists():
        start, _ = load_training_state(run_dir / "state", drafter, trainer.optimizer)
        print(f"[train] resuming {kind} at step {start}/{config.steps}", flush=True)
    if rank == 0 and start > 0 and history.exists():
        trim_records(history, start)
    if rank == 0 and start > 0 and changes:
        append_record(history, {"event": "override", "step": start, "changed": changes})
        print(f"[train] --override: continuing with {_describe(changes)} (recorded in {history})", flush=True)
    if rank == 0:
        print(f"[train] precision {config.precision} on {where}", flush=True)
    if rank == 0 and start == 0:
        coverage = {"train": _vocab_coverage(store, train_ids, drafter.head.draft_vocab_ids),
                    "val": _vocab_coverage(store, val_ids, drafter.head.draft_vocab_ids)}
        write_records(history, [{"event": "config", "kind": kind, "target": target.name,
                                       "train_sequences": len(train_ids), "val_sequences": len(val_ids),
                                       "train_tokens": sum(store.lengths[i] for i in train_ids),
                                       "trainable_params": drafter.num_trainable_params(),
                                       "draft_vocab_size": drafter.config.draft_vocab_size,
                                       "draft_vocab_coverage": coverage,
                                       "init_from": None if init_from is None else str(init_from),
                                       "features": features, "device": str(where),
                                       "world_size": world, **asdict(config), "settings": settings}])
    return TrainingRun(kind, run_dir, config, target, drafter, trainer, val_ids, start, rank, world)


def take_steps(run: TrainingRun, log_every: int = 10, val_every: int = 100, save_minutes: float = 10.0,
               on_step: StepHook | None = None) -> None:
    """The recipe's steps from `run.start` on: each logged every `log_every` steps, validated every `val_every`,
    the state saved at each validation, once `save_minutes` have passed since the last save, and on
    SIGINT/SIGTERM, after which the process exits (128 + the signal) for a rerun to resume."""
    config, trainer, history = run.config, run.trainer, run.history
    bar = tqdm(total=config.steps, initial=run.start, desc=f"train {run.kind}", unit="step", disable=run.rank != 0)
    last_save = time.monotonic()
    with StopRequest() as stop:
        for step in range(run.start, config.steps):
            log = trainer.train_step(step)
            if on_step is not None:
                on_step(step + 1)
            bar.update(1)
            bar.set_postfix(loss=f"{log.loss:.3f}", lr=f"{log.lr:.1e}")
            last = step + 1 == config.steps
            if run.rank == 0 and (step % log_every == 0 or last):
                append_record(history, {"event": "step", **asdict(log)})
            if run.rank == 0 and run.val_ids and ((step + 1) % val_every == 0 or last):
                stats = trainer.validate(run.val_ids)
                in_order = trainer.validate_in_decode_order(run.val_ids)
                append_record(history, {"event": "validation", "step": step + 1, **stats.to_dict(),
                                  "decode_order": in_order.to_dict()})
                bar.write(f"[train] step {step + 1}: validation tau {stats.mean_accepted_length:.2f} "
                          f"(in decode order {in_order.mean_accepted_length:.2f}), "
                          f"acceptance {[round(a, 2) for a in stats.acceptance_by_position]}")
            due = time.monotonic() - last_save >= 60 * save_minutes
            if run.rank == 0 and ((step + 1) % val_every == 0 or last or stop.requested or due):
                save_training_state(run.run_dir / "state", run.drafter, trainer.optimizer, step + 1,
                                    {"kind": run.kind})
                last_save = time.monotonic()
            if stop.requested and not last:
                bar.write(f"[train] signal {stop.signal_number}: stopped after step {step + 1} with its state "
                          f"saved in {run.run_dir / 'state'}; rerun the same command to resume")
                raise SystemExit(128 + stop.signal_number)  # type: ignore[operator]
    bar.close()


def save_run(run: TrainingRun) -> Path:
    """The trained drafter saved in `run_dir/drafter` (by rank 0; every rank then leaves the process group)."""
    out = run.run_dir / "drafter"
    if run.rank == 0:
        save_drafter(run.drafter, out, verifier_name_or_path=run.target.name,
                     verifier_architectures=[run.target.config.architecture])
    if run.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return out


# What a resumed run must share with the run that wrote its state, and the flag that sets each (the
# recipe's other fields have no flag). The device is not among them: a run may move to another one.
_SETTING_FLAGS = {"kind": "--drafter", "target": "--target", "features": "--features/--corpus",
                  "draft_vocab_size": "--draft-vocab", "init_from": "--init-from", "val_every": "--val-every",
                  "world_size": "torchrun --nproc-per-node", "steps": "--steps", "lr": "--lr",
                  "seqs_per_step": "--seqs-per-step", "anchors_per_seq": "--anchors-per-seq", "seed": "--seed",
                  "precision": "--precision"}


def run_settings(kind: str, target_name: str, features: str, config: TrainConfig, draft_vocab_size: int | None,
                 init_from: Path | None, val_every: int, val_sequences: int, world_size: int,
                 drafter_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings of a run that a resume must keep, JSON-ready (as recorded in history.jsonl)."""
    settings = {"kind": kind, "target": target_name, "features": features, "draft_vocab_size": draft_vocab_size,
                "init_from": None if init_from is None else str(init_from), "val_every": val_every,
                "val_sequences": val_sequences, "world_size": world_size, **asdict(config),
                "drafter_options": dict(drafter_options or {})}
    return json.loads(json.dumps(settings, default=str))


def resume_changes(history: Path, settings: dict[str, Any]) -> dict[str, list[Any]]:
    """{setting: [recorded, now]} for every recorded setting that `settings` changes (empty: none)."""
    recorded = recorded_settings(history) or {}
    return {k: [v, settings[k]] for k, v in recorded.items() if k in settings and settings[k] != v}


def recorded_settings(history: Path) -> dict[str, Any] | None:
    """The settings a run's history records (None: no history, or no config record in it).

    They are the config record's, updated by each `--override` record after it. A history from before
    settings were recorded gives what its config record holds as given (the recipe, kind, features,
    init_from, world size; not its measured val_sequences or draft vocabulary). A history that records no
    precision comes from before `--precision` existed, when every run trained in fp32: it gets fp32.
    """
    if not history.exists():
        return None
    as_given = {*asdict(TrainConfig()), "kind", "features", "init_from", "world_size"}
    recorded: dict[str, Any] | None = None
    for record in read_records(history):
        if record.get("event") == "config":
            recorded = record.get("settings") or {k: record[k] for k in as_given if k in record}
        elif record.get("event") == "override" and recorded is not None:
            recorded.update({k: new for k, (_, new) in record["changed"].items()})
    if recorded is not None:
        recorded.setdefault("precision", "fp32")
    return recorded


def _describe(changes: dict[str, list[Any]]) -> str:
    """'--steps 100 -> 200, --lr 0.0006 -> 0.001'."""
    return ", ".join(f"{_SETTING_FLAGS.get(k, k)} {old} -> {new}" for k, (old, new) in changes.items())


def validate_drafters(target_name: str, features_dirs: list[Path], drafter_dirs: list[Path], out_dir: Path,
                      val_sequences: int = 24, stem: str = "validation",
                      target: Target | None = None) -> tuple[Path, Path]:
    """`hspec validate`: both validations of saved drafters on the held-out split `hspec train` uses.

    Given the feature dirs of a training run, in the same order, these are that run's held-out sequences
    and anchors, so a drafter trained before the decode-order validation existed can be compared with a
    later one. Writes `<stem>.json` and `<stem>.md` under `out_dir`. `target`: the target `target_name`
    names, already loaded; None loads it.
    """
    from hspec.training.report import write_validation_report

    if target is None:
        target = load_target(target_name)
    store = FeatureStores(features_dirs)
    val_ids = held_out_ids(store, val_sequences)
    if not val_ids:
        raise ValueError(f"no held-out sequences in {[str(d) for d in features_dirs]} (1 in 20 ids are held out)")
    rows = []
    for path in drafter_dirs:
        drafter = load_drafter(path, target.model)
        trainer = Trainer(drafter, target.model, store.load, val_ids, TrainConfig(steps=1))
        anchors, in_order = trainer.validate(val_ids), trainer.validate_in_decode_order(val_ids)
        rows.append({"drafter": str(path), "kind": drafter.kind, "anchors": anchors.to_dict(),
                     "decode_order": in_order.to_dict()})
    command = (f"hspec validate {' '.join(str(d) for d in drafter_dirs)} --features "
               f"{','.join(str(d) for d in features_dirs)}")
    return write_validation_report(rows, command, {"target": target.name, "val_sequences": len(val_ids)},
                                   out_dir, stem)


def _feature_source(target: Target, features_dirs: list[Path],
                    corpora: list[Path] | None) -> FeatureStores | OnlineFeatures:
    """Cached features, or the corpora with features computed online by `target` when `corpora` is given."""
    if not corpora:
        return FeatureStores(features_dirs)
    layers = select_target_layers(target.config.num_layers)
    return OnlineFeatures(corpora, target.model, target.name, layers, [kv_layer_of(layer) for layer in layers])


def _initial_drafter(path: Path, kind: str, target_model: torch.nn.Module,
                     draft_vocab_size: int | None) -> NeuralDrafter:
    """The saved drafter at `path`, checked to be a `kind` with the requested draft vocabulary size."""
    info = read_checkpoint(path)
    if info.kind != kind:
        grown = DRAFTERS.get(kind)
        if info.kind in grown.starts_from:  # e.g. DeLS-Spec: a local head trained over a frozen, trained DFlash
            return grown.start_from(load_drafter(path, target_model, dtype=torch.float32), target_model)
        raise ValueError(f"--init-from {path} holds a {info.kind!r} drafter, not the {kind!r} being trained")
    saved_vocab = info.drafter_config.draft_vocab_size
    if draft_vocab_size is not None and draft_vocab_size != saved_vocab:
        raise ValueError(f"--draft-vocab {draft_vocab_size} differs from the draft vocabulary of --init-from "
                         f"{path} ({saved_vocab}); omit it to keep the saved one")
    return load_drafter(path, target_model, dtype=torch.float32)


def _token_counts(store: FeatureStores, train_ids: list[int], vocab_size: int) -> torch.Tensor:
    """(V,) how often each target id occurs in the training sequences."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in train_ids:
        counts += torch.bincount(store.tokens(i).long().cpu(), minlength=vocab_size)
    return counts


def _draft_vocabulary(store: FeatureStores, train_ids: list[int], vocab_size: int, keep: int) -> torch.Tensor:
    """The pruned vocabulary: the `keep` most frequent tokens of the training sequences."""
    return most_frequent_tokens((store.tokens(i).tolist() for i in train_ids), vocab_size, keep)


def _vocab_coverage(store: FeatureStores, ids: list[int], vocab: torch.Tensor) -> float | None:
    """The share of the tokens of sequences `ids` that lie inside the draft vocabulary (None: no tokens)."""
    inside = total = 0
    for i in ids:
        tokens = store.tokens(i)
        inside += int(torch.isin(tokens, vocab.cpu()).sum())
        total += tokens.numel()
    return inside / total if total else None


def process_group_backend(device: torch.device) -> str:
    """The collective backend for gradients living on `device`: nccl for a GPU, gloo for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def _init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world size); under torchrun, joins the process group with the backend `device` needs."""
    if "RANK" not in os.environ or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL works on the current device: make it this process's own GPU
    dist.init_process_group(process_group_backend(device))
    return dist.get_rank(), dist.get_world_size()


def _finished(run_dir: Path, steps: int) -> bool:
    """Whether `run_dir` saved a training state at `steps` (or later) and its final drafter."""
    states = training_states(run_dir / "state")
    done = bool(states) and int(states[-1].name.split("-")[1]) >= steps
    return done and (run_dir / "drafter" / "config.json").exists()


