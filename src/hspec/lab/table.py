"""`hspec lab table`: every drafter of a comparison folder on one row, across its evaluations.

A comparison folder (scripts/compare_long.sh) holds the merged evaluations that `hspec lab claims` reads
(`claims.EVAL_FILES`) and, under `shards/<shard>/runs/<run>/history.jsonl`, the training history of every
drafter its shards trained. The table gives each drafter kind:

- the shard that trained and evaluated it (read from the merged files' provenance and the shards' runs; a
  run's history joins the row of the label evaluated from it: its name, or "<kind>@<run>" for a run of
  another name);
- its last validation tau on the held-out responses, teacher-forced and in decode order, and its training
  time (`training_minutes`), from its history;
- for each evaluation present, its MAL tau and its speedup over the plain decoding it ran beside (one cell
  per K in a draft-length sweep), as the evaluation's own summary states them.

Nothing is recomputed: each number is copied from the file that measured it, so the copy of the table in
results/comparison_long/README.md (tests/test_readme_tables.py) cannot drift from the results.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hspec.eval.labels import split_sweep_label
from hspec.lab.claims import load_evals
from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.training.report import read_history, training_minutes

STEM = "eval_table"
PLAIN = "none"


def column_title(settings: Mapping[str, Any]) -> str:
    """What an evaluation ran, from its settings: tasks, items per task, K, temperature."""
    k = settings.get("K")
    ks = "/".join(str(x) for x in k) if isinstance(k, list) else str(k)
    temperature = settings.get("temperature", 0.0)
    sampling = "greedy" if not temperature else f"T = {temperature:g}"
    tasks = str(settings.get("tasks", "?")).replace(",", ", ")
    return f"{tasks}, K = {ks}, {sampling} ({settings.get('size_per_task', '?')} items a task)"


def build_table(folder: Path) -> dict[str, Any]:
    """The table's rows, columns and plain decoding's ms/token for each evaluation of `folder`.

    Raises FileNotFoundError when the folder holds no evaluation `hspec lab claims` reads, ValueError when two
    shards kept a training history under the same run name.
    """
    evals = load_evals(folder)
    histories = _histories(folder)
    columns = {stem: column_title(payload["provenance"].get("settings", {})) for stem, payload in evals.items()}
    plain_ms = {stem: payload["summary"]["tasks"]["all"].get(PLAIN, {}).get("itl_ms")
                for stem, payload in evals.items()}
    rows: dict[str, dict[str, Any]] = {}
    for stem, payload in evals.items():
        shard_of = _shard_of_labels(payload)
        for label, entry in payload["summary"]["tasks"]["all"].items():
            if label == PLAIN:
                continue
            kind, k = split_sweep_label(label)
            row = rows.setdefault(kind, {"drafter": kind, "shard": None, "evals": {}})
            row["shard"] = row["shard"] or shard_of.get(label)
            row["evals"].setdefault(stem, []).append({"K": k if k is not None else payload["summary"]["K"].get(label),
                                                      "tau": entry.get("mean_accepted_length"),
                                                      "speedup": entry.get("speedup")})
    for name, (shard, history) in histories.items():
        label = name if name in rows else next((label for label in rows if _run_of(label) == name), name)
        row = rows.setdefault(label, {"drafter": label, "shard": shard, "evals": {}})
        row["shard"] = row["shard"] or shard
        last = history["validations"][-1] if history["validations"] else {}
        row["val_tau"] = last.get("mean_accepted_length")
        row["val_tau_decode_order"] = last.get("decode_order", {}).get("mean_accepted_length")
        row["val_step"] = last.get("step")
        row["train_minutes"] = training_minutes(history)
    return {"columns": columns, "plain_ms_per_token": plain_ms, "rows": list(rows.values())}


def _run_of(label: str) -> str:
    """The run a method label was evaluated from: "<kind>@<run>" names it, a bare kind is its own run."""
    return label.rsplit("@", 1)[-1]


def _histories(folder: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    """Run name -> (its shard, its read history), for every history kept under folder/shards/*/runs/."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for path in sorted(folder.glob("shards/*/runs/*/history.jsonl")):
        name, shard = path.parent.name, path.parent.parent.parent.name
        if name in found:
            raise ValueError(f"two shards kept a training history of the run '{name}': {found[name][0]} and "
                             f"{shard}; remove the one that was not evaluated")
        found[name] = (shard, read_history(path.parent))
    return found


def _shard_of_labels(payload: Mapping[str, Any]) -> dict[str, str]:
    """Method label -> the shard folder it was evaluated in, for a merged evaluation (`hspec lab merge`)."""
    out = {}
    for shard in payload["provenance"].get("shards", []):
        for label in str(shard.get("methods", "")).split(","):
            if label:
                out[label] = Path(shard["file"]).parent.name
    return out


def render_rows(table: Mapping[str, Any]) -> list[str]:
    """The markdown table itself (header, rule, one line per drafter, plain decoding last)."""
    stems = list(table["columns"])
    lines = ["| drafter | shard | trained (min) | val tau (decode order) | "
             + " | ".join(table["columns"][s] for s in stems) + " |",
             "|---|---|---|---|" + "---|" * len(stems)]
    for row in table["rows"]:
        tau = row.get("val_tau")
        val = "-" if tau is None else f"{tau:.2f} ({_num(row.get('val_tau_decode_order'))})"
        cells = [_cell(row["evals"].get(stem, [])) for stem in stems]
        minutes = row.get("train_minutes")
        trained = "-" if minutes is None else f"{minutes:.0f}"
        lines.append(f"| {row['drafter']} | {row['shard'] or '-'} | {trained} | {val} | " + " | ".join(cells) + " |")
    plain = [f"{ms:.1f} ms/token" if ms is not None else "-" for ms in (table["plain_ms_per_token"][s] for s in stems)]
    lines.append("| plain decoding | - | - | - | " + " | ".join(plain) + " |")
    return lines


def _cell(runs: Sequence[Mapping[str, Any]]) -> str:
    """"tau / speedupx" of one drafter in one evaluation; each K named where it ran several."""
    if not runs:
        return "-"
    parts = [f"{_num(r['tau'])} / {_num(r['speedup'])}x" for r in sorted(runs, key=lambda r: r["K"])]
    if len(runs) > 1:
        parts = [f"K {r['K']}: {part}" for r, part in zip(sorted(runs, key=lambda r: r["K"]), parts)]
    return ", ".join(parts)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def render_table(payload: Mapping[str, Any]) -> str:
    lines = ["# Every drafter across the evaluations\n", provenance_markdown(payload["provenance"]), "",
             *render_rows(payload["table"]), "",
             "Cells: MAL tau / speedup over the plain decoding each drafter ran beside (its own shard's), as each "
             "evaluation's summary states them; tau counts the tokens each verify step emits. val tau: the last "
             "validation of the drafter's training run, teacher-forced on the held-out responses (in decode order "
             "in brackets); trained: its training time, the mean logged step time x steps (as training.md states it, "
             "without validations and pauses). Plain decoding's ms/token is the first evaluated shard's. Claims and "
             "their CIs: claims.md."]
    return "\n".join(lines) + "\n"


def write_table(folder: Path, out_dir: Path | None = None, command: str = "hspec lab table") -> tuple[Path, Path]:
    """Write eval_table.json + eval_table.md for `folder` into `out_dir` (default: the folder)."""
    payload = {"provenance": provenance(command, {"folder": str(folder)}), "table": build_table(folder)}
    return write_results(out_dir or folder, STEM, payload, render_table(payload))
