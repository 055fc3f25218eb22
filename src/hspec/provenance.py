"""Provenance and writing of results (JSON + markdown side by side), for every command that writes to
results/: benchmarks, evaluations, training reports. It sits on the lowest floor so all of them can use it."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from hspec.machine import cpu_flags


def provenance(command: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Machine, commit, date, command and settings, recorded with every result.

    `tree_dirty` is True when tracked files differed from the commit while the result was made (the
    commit then also ends in `-dirty`): that commit alone may not reproduce it. None outside git.
    """
    commit, dirty = _git_state()
    return {
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "tree_dirty": dirty,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpu_features": _cpu_features(),
            "hspec_cpu_capability": os.environ.get("HSPEC_CPU_CAPABILITY") or "auto",
        },
        "settings": settings,
    }


def provenance_markdown(meta: dict[str, Any]) -> str:
    """The provenance as a markdown list; a dirty tree gets a line of its own that says so."""
    m = meta["machine"]
    device = m["cuda"] or f"CPU ({m['processor']}, {m['cpu_count']} cores, {m['torch_threads']} torch threads)"
    settings = ", ".join(f"{k}={v}" for k, v in meta["settings"].items())
    # Files written before `tree_dirty` existed say it only through the commit's suffix.
    dirty = meta["tree_dirty"] if "tree_dirty" in meta else (str(meta["commit"]).endswith("-dirty") or None)
    tree = ("- tree_dirty: true (tracked files differed from this commit when this ran; the commit alone may "
            "not reproduce it)\n" if dirty else "- tree_dirty: false\n" if dirty is not None else "")
    resumed = (f"- commits: {', '.join(meta['commits'])} (a resumed run: its items were made at these commits)\n"
               if meta.get("commits") else "")
    kernels = ""  # files written before these fields existed lack them
    if m.get("cpu_features") is not None:
        kernels = f", CPU features {' '.join(m['cpu_features']) or 'none of ' + ' '.join(_FEATURES)}"
    if m.get("hspec_cpu_capability", "auto") != "auto":
        kernels += f", HSPEC_CPU_CAPABILITY={m['hspec_cpu_capability']}"
    return (f"- command: `{meta['command']}`\n- date: {meta['date']}\n- commit: {meta['commit']}\n{resumed}{tree}"
            f"- machine: {device}, {m['platform']}, torch {m['torch']}{kernels}\n- settings: {settings}\n")


# The CPU features that decide which kernels run (models/dtype.py, models/cpu_kernels.cpp).
_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def _cpu_features() -> list[str] | None:
    """Which of `_FEATURES` this CPU has (`machine.cpu_flags`); None where its flags cannot be read."""
    flags = cpu_flags()
    return [f for f in _FEATURES if f in flags] if flags else None


def write_results(out_dir: Path, stem: str, payload: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write `<stem>.json` and `<stem>.md` atomically (a killed run never leaves half a file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = (out_dir / f"{stem}.json", out_dir / f"{stem}.md")
    for path, text in zip(paths, (json.dumps(payload, indent=2, default=_jsonable) + "\n", markdown)):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return paths


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and x != x:
        return None
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def _git_state(where: Path | None = None) -> tuple[str, bool | None]:
    """(short commit, + "-dirty" when tracked files differ from it; whether they do), or ("unknown", None).

    `where`: a folder inside the repository (default: this package's). Files under the repository's
    `results/` do not count: they are what benchmark commands write, never what a run reads, so a run
    made while earlier results were still uncommitted is as reproducible as one made after.
    """
    here = where or Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=here)
        if out.returncode != 0:
            return "unknown", None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                 ":(top,exclude)results"], capture_output=True, text=True, timeout=5, cwd=here)
        dirty = bool(status.stdout.strip())
        return out.stdout.strip() + ("-dirty" if dirty else ""), dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
