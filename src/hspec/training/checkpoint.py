"""Trainer state for exact resume: the drafter's weights, the optimizer, the step and the caller's extras.

A run keeps it in `<dir>/step-<step>/` (drafter.safetensors + trainer_state.pt). Like a drafter checkpoint
(`hspec.drafters.checkpoint`, where the Speculators-format save/load/export live), every write goes to a
hidden temporary directory that is renamed into place, so a killed save never leaves a half state where
a resume would read it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hspec.drafters.checkpoint import load_weights, own_tensors
from hspec.drafters.common import NeuralDrafter
from hspec.durable import atomic_directory

STATE_WEIGHTS_FILE = "drafter.safetensors"
STATE_TRAINER_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def save_training_state(directory: str | Path, drafter: NeuralDrafter, optimizer: torch.optim.Optimizer,
                        step: int, extra: dict[str, Any] | None = None, keep_last: int = 1) -> Path:
    """Save what an exact resume needs as `directory`/step-<step>/, then keep only the last `keep_last`.

    extra: the caller's state (scheduler, generator states, data position...): tensors, numbers,
    strings, and lists/tuples/dicts of them (loaded back with `torch.load(weights_only=True)`).
    Atomic: a step directory appears complete or not at all, and `directory` itself only exists once
    it holds one. Pass the unwrapped drafter under DDP/FSDP (`model.module`). Returns the step directory.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    directory = Path(directory)
    name = f"step-{step:09d}"
    state = {"step": step, "kind": drafter.kind, "optimizer": optimizer.state_dict(), "extra": dict(extra or {})}

    def write(step_dir: Path) -> None:
        step_dir.mkdir(parents=True, exist_ok=True)
        save_file(own_tensors(drafter), str(step_dir / STATE_WEIGHTS_FILE), metadata={"format": "pt"})
        torch.save(state, step_dir / STATE_TRAINER_FILE)

    if directory.is_dir():
        with atomic_directory(directory / name) as tmp:
            write(tmp)
    else:  # the first save: build `directory` with its step inside, then publish both with one rename
        with atomic_directory(directory) as tmp:
            write(tmp / name)
    for stale in training_states(directory)[:-keep_last]:
        shutil.rmtree(stale, ignore_errors=True)
    return directory / name


def training_states(directory: str | Path) -> list[Path]:
    """The complete step directories under `directory`, oldest first (empty if there are none)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(steps)]


def load_training_state(directory: str | Path, drafter: NeuralDrafter, optimizer: torch.optim.Optimizer,
                        step: int | None = None) -> tuple[int, dict[str, Any]]:
    """Restore the latest (or the given `step`'s) state into `drafter` and `optimizer`.

    The optimizer must be built over the drafter's parameters in the same order as when saved.
    Returns (step, extra).
    """
    directory = Path(directory)
    states = training_states(directory)
    if step is not None:
        states = [p for p in states if p.name == f"step-{step:09d}"]
    if not states:
        which = "" if step is None else f" for step {step}"
        raise FileNotFoundError(f"no training state{which} under {directory}")
    step_dir = states[-1]
    trainer_path = step_dir / STATE_TRAINER_FILE
    if not trainer_path.is_file():
        raise FileNotFoundError(f"{trainer_path} not found")
    try:
        state = torch.load(trainer_path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for a truncated or foreign pickle
        raise ValueError(f"{trainer_path}: unreadable trainer state ({err})") from err
    if state.get("kind") != drafter.kind:
        raise ValueError(f"{trainer_path} is for drafter kind {state.get('kind')!r}, not {drafter.kind!r}")
    load_weights(drafter, step_dir / STATE_WEIGHTS_FILE)
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as err:
        raise ValueError(f"{trainer_path}: optimizer state does not fit this optimizer ({err})") from err
    return int(state["step"]), state["extra"]
