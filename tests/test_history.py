"""A run's history.jsonl under faults: a torn last line is dropped with a warning, a bad line elsewhere names
itself, and a kill during a rewrite leaves the old file or the new one whole (`hspec.training.history`)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hspec import durable
from hspec.durable import remove_stale_temporaries
from hspec.training.history import append_record, read_records, trim_records, write_records

SRC = Path(__file__).resolve().parents[1] / "src"


def _records(steps: int) -> list[dict]:
    return [{"event": "config", "steps": steps}] + [{"event": "step", "step": i, "loss": 1.0 / (i + 1),
                                                     "note": "x" * 100} for i in range(steps)]


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / "history.jsonl"
    write_records(path, _records(3))
    with path.open("a") as f:
        f.write('{"event": "step", "step": 3, "lo')  # what a kill during an append leaves
    with pytest.warns(UserWarning, match=f"{path}: its last line is torn"):
        assert read_records(path) == _records(3)
    with pytest.warns(UserWarning, match="torn"):
        trim_records(path, 3)  # the trim on resume drops it from the file too
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in _records(3))


def test_a_bad_line_before_the_last_names_the_file_and_line(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_text('{"event": "config"}\n{"event": "st\n{"event": "step", "step": 0}\n')
    with pytest.raises(ValueError, match=f"{path}, line 2: not a JSON record"):
        read_records(path)
    path.write_text('{"event": "config"}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2: expected a JSON object, got list"):
        read_records(path)


def test_each_append_reaches_the_disk_before_it_returns(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(durable.os, "fsync", synced.append)
    path = tmp_path / "history.jsonl"
    append_record(path, {"event": "step", "step": 0})
    assert len(synced) == 1 and read_records(path) == [{"event": "step", "step": 0}]


def test_a_kill_during_a_rewrite_leaves_the_old_file_or_the_new(tmp_path):
    """A child allowed to write 4 KB to any file trims a ~12 KB history: the rewrite dies partway (SIGXFSZ, as
    a kill); the history still holds the old records, whole. Unhindered, the trim then writes the new ones."""
    path = tmp_path / "history.jsonl"
    write_records(path, _records(100))
    old = path.read_bytes()
    script = "\n".join([
        "import resource, signal, sys",
        "from pathlib import Path",
        "from hspec.training.history import trim_records",
        "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))",
        "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it (the write fails); die as a kill would",
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))",
        "trim_records(Path(sys.argv[1]), 90)",
    ])
    child = subprocess.run([sys.executable, "-c", script, str(path)], env={"PYTHONPATH": str(SRC)},
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGXFSZ, child.stderr
    assert path.read_bytes() == old
    trim_records(path, 90)
    assert read_records(path) == _records(100)[:91]
    # the killed rewrite's temporary file is what a run's start clears (`remove_stale_temporaries`)
    [leftover] = tmp_path.glob(".history.jsonl.tmp-*")
    assert remove_stale_temporaries(tmp_path) == [f"removed {leftover} (an interrupted rewrite's incomplete "
                                                  "temporary file)"]
    assert [p.name for p in tmp_path.iterdir()] == ["history.jsonl"]
