"""The finished items of an `hspec eval` run, kept on disk so that a killed run resumes where it stopped.

An evaluation of many drafters takes hours on a CPU. `ItemLog` appends each finished item's records
(every turn, every method, timed back to back in one process) as one JSON line to
`<out>/<stem>.partial.jsonl`, after a first line with the run's settings. Rerunning the same command
reads the finished items back and decodes only the others; the file is deleted once the report is
written. Items are the unit because a multi-turn item's later turns need its earlier answers.

Every line records the commit it was made at, so a report assembled over several commits says so
(`commits`). A file whose settings differ from the new run's is never mixed in: the run stops and names
the settings that differ. The settings record each checkpoint's digest (`runner.run_eval`), so a log
made with a drafter since retrained is refused too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class ItemLog:
    """Append-only log of finished items for one evaluation (`path`), made under `settings`."""

    def __init__(self, path: Path, settings: dict[str, Any], commit: str) -> None:
        self.path = path
        self.commit = commit
        self.settings = json.loads(json.dumps(settings))  # as the file will read back
        self.records: list[dict[str, Any]] = []  # the finished items' records, in file order
        self.done: set[tuple[str, str]] = set()  # (task, item id)
        self.commits: list[str] = []  # every commit that wrote an item, first seen first
        if path.exists() and path.stat().st_size > 0:
            self._read()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")
            self._append({"settings": self.settings})

    def add(self, task: str, item: str, records: list[dict[str, Any]]) -> None:
        """Keep one finished item's records (flushed to disk before returning)."""
        self._append({"task": task, "item": item, "commit": self.commit, "records": records})
        self._keep(task, item, self.commit, records)

    def finish(self) -> None:
        """The report is written: the log is no longer needed."""
        self.path.unlink(missing_ok=True)

    def _keep(self, task: str, item: str, commit: str, records: list[dict[str, Any]]) -> None:
        self.records.extend(records)
        self.done.add((task, item))
        if commit not in self.commits:
            self.commits.append(commit)

    def _read(self) -> None:
        lines = self.path.read_text().splitlines()
        header = json.loads(lines[0]) if lines else {}
        theirs = header.get("settings")
        if theirs != self.settings:
            differ = sorted(k for k in set(self.settings) | set(theirs or {})
                            if (theirs or {}).get(k) != self.settings.get(k))
            raise ValueError(f"{self.path} holds finished items of another evaluation (settings that differ: "
                             f"{', '.join(differ) or 'the header'}); rerun with the same settings to resume it, "
                             f"or delete it to start over")
        for number, line in enumerate(lines[1:], start=2):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                if number < len(lines):
                    raise ValueError(f"{self.path}:{number} is not a JSON line; delete the file to start "
                                     f"over") from None
                # the last line, cut short by a kill: drop it, and that item runs again
                self.path.write_text("".join(kept + "\n" for kept in lines[:-1]))
                break
            self._keep(entry["task"], entry["item"], entry["commit"], entry["records"])

    def _append(self, entry: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
