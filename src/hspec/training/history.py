"""A run's `history.jsonl`: one JSON record a line (config, step logs, validations, overrides).

The history is what a resume checks its settings against (the config record), so it must survive a kill:

- each record is appended, flushed and fsynced (`append_record`); a kill mid-append can tear only the
  last line, which `read_records` then drops with a warning (the step it logged is redone on resume);
- a rewrite (the first record of a fresh run, the trim on resume) replaces the file whole
  (`write_records`, through `hspec.durable.write_text_atomically`), so a kill leaves the old file or the
  new one, never a file without its config record.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from hspec.durable import append_line, write_text_atomically

HISTORY_FILE = "history.jsonl"


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of the history at `path`, in order.

    A last line that is not a whole JSON record (a kill tore it while it was appended) is dropped with a
    warning; a bad line anywhere else is a damaged file: ValueError naming the file and the line.
    """
    lines = path.read_text().split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for number, line in enumerate(lines[: last + 1], start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == last + 1:
                warnings.warn(f"{path}: its last line is torn ({len(line)} characters, {err.msg}), as a kill "
                              "during an append leaves it; dropped", stacklevel=2)
                break
            raise ValueError(f"{path}, line {number}: not a JSON record ({err}); the history is damaged") from err
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append `record` as one line, on disk before this returns."""
    append_line(path, json.dumps(record, default=str))


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace the history at `path` by `records`, whole (a kill leaves the old file or this one)."""
    write_text_atomically(path, "".join(json.dumps(record, default=str) + "\n" for record in records))


def trim_records(path: Path, step: int) -> None:
    """Drop the records of steps after `step` (a resumed run redoes them), and a torn last line; atomic."""
    kept = []
    for record in read_records(path):
        logged_step = record["step"] + 1 if record.get("event") == "step" else record.get("step", 0)
        if logged_step <= step:
            kept.append(record)
    write_records(path, kept)
