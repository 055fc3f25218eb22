"""Writes that a kill cannot leave half done: whole directories, whole files, appended lines.

A process can die at any instant (SIGKILL, a lost machine, a full disk). What it was writing must then
read as before or as after, never as a mix, or the next run crashes on it or, worse, trusts it:

- a directory (a checkpoint, a converted target) is written into a hidden temporary sibling, flushed to
  disk and renamed into place (`atomic_directory`); `remove_stale_temporaries` clears what a kill left;
- a file that is rewritten (a run's history trimmed on resume) goes to a temporary sibling that
  `os.replace` swaps in (`write_text_atomically`);
- a log that only grows gets each line flushed and fsynced as it is appended (`append_line`), so a kill
  can tear at most its last line, which its reader then drops;
- a destination the caller means to replace is checked to be one of its own outputs first
  (`check_replaceable`), so a typo in an output path cannot delete someone's folder.

The renames stay on one file system because every temporary lives in the destination's own folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# Hidden siblings `atomic_directory` makes: the directory being written, and the previous one moved aside.
TMP_MARK, OLD_MARK = ".tmp-", ".old-"


@contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield an empty temporary directory beside `path`; on success it replaces `path`, else it is removed.

    The temporary directory is hidden (`.<name>.tmp-*`) in the same parent. Replacing an existing `path`
    takes two renames (old aside, new in); if the second fails, the old one is put back, and if the process
    dies between them, the previous directory is at `.<name>.old-*/checkpoint` (`remove_stale_temporaries`
    restores it).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent))
    try:
        yield tmp
        fsync_tree(tmp)
        _replace_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(path.parent)


def _replace_directory(new: Path, path: Path) -> None:
    """Rename `new` to `path`, replacing a directory that is already there (see `atomic_directory`)."""
    if not path.exists():
        os.rename(new, path)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}{OLD_MARK}", dir=path.parent))
    os.rename(path, old / "checkpoint")
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(old / "checkpoint", path)
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def remove_stale_temporaries(directory: str | Path, name: str | None = None) -> list[str]:
    """Clear what killed `atomic_directory` writes left in `directory`; returns one line per thing done.

    `name`: only the temporaries of `directory/name` (None: of every entry). Call this only when no write
    into them is running (the caller holds its lock, or is the only writer). A `.<name>.tmp-*` folder was
    never renamed into place, so it is incomplete: removed. A `.<name>.old-*` folder holds what a replace
    moved aside: removed if `<name>` is back in place (the replace finished), else moved back to `<name>`
    (the process died between the two renames, so it is the latest complete one). A `.<name>.tmp-*` file
    (`write_text_atomically`) was never swapped in: removed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    done = []
    for entry in sorted(directory.iterdir()):
        if not entry.name.startswith("."):
            continue
        if name is not None and not entry.name.startswith((f".{name}{TMP_MARK}", f".{name}{OLD_MARK}")):
            continue
        if TMP_MARK in entry.name and entry.is_file():  # `write_text_atomically`'s, never swapped in
            entry.unlink(missing_ok=True)
            done.append(f"removed {entry} (an interrupted rewrite's incomplete temporary file)")
        elif not entry.is_dir():
            continue
        elif TMP_MARK in entry.name:
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"removed {entry} (an interrupted save's incomplete temporary folder)")
        elif OLD_MARK in entry.name:
            path = directory / entry.name[1:].rpartition(OLD_MARK)[0]
            if not path.exists() and (entry / "checkpoint").is_dir():
                os.rename(entry / "checkpoint", path)
                shutil.rmtree(entry, ignore_errors=True)
                done.append(f"restored {path} from {entry} (a save died while replacing it)")
            else:
                shutil.rmtree(entry, ignore_errors=True)
                done.append(f"removed {entry} (the previous checkpoint, already replaced)")
    return done


def check_replaceable(path: Path, is_earlier_output: Callable[[Path], bool], what: str) -> None:
    """Raise FileExistsError unless `path` is absent, an empty directory, or one `is_earlier_output` accepts.

    A writer that replaces its destination whole (`atomic_directory`) deletes what was there; this keeps
    that to the writer's own earlier outputs. `what` names them in the message ("a drafter checkpoint").
    """
    if not path.exists():
        return
    if path.is_dir() and (not any(path.iterdir()) or is_earlier_output(path)):
        return
    raise FileExistsError(f"refusing to replace {path}: it exists and is not {what}; remove it yourself or "
                          "choose another destination")


def write_text_atomically(path: Path, text: str) -> None:
    """Replace the file `path` by `text` whole: a kill at any instant leaves the old contents or the new."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{TMP_MARK}", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def append_line(path: Path, line: str) -> None:
    """Append `line` and a newline to `path`, on disk before returning (flushed and fsynced)."""
    with path.open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(directory: Path) -> None:
    """Flush every file under `directory`, then the directories, so a rename publishes complete data."""
    for root, _, files in os.walk(directory):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def fsync_path(path: Path) -> None:
    """Flush one file or directory to disk; a file system that cannot fsync a directory is let be."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory; the data files are already flushed
        pass
    finally:
        os.close(fd)
