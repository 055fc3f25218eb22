"""Evaluation task suites: fixed, deterministic prompt sets read from a data folder.

The data folder is the one shipped in this package (`hspec/data/`, sources and licences in its
README.md) unless a caller passes `data_dir` (the CLI's `--data-dir`) or sets $HSPEC_DATA_DIR. It holds
normalised JSONL files: one JSON object per line with `id`, `category` and `turns` (the user turns);
a file may also be gzip-compressed (`<name>.gz`). A task is a list of `EvalItem`s; multi-turn items
keep every turn, and the caller generates the answers turn by turn.

Tasks (`TASK_NAMES`):

- `spec_bench`: all of Spec-Bench, item categories = its six categories (`SPEC_BENCH_CATEGORIES`);
  the 8 MT-bench categories (writing … humanities, question ids 81–160) are reported as `mt_bench`.
- `translation`, `summarization`, `qa`, `math_reasoning`, `rag`: one Spec-Bench category each.
- `mt_bench`: the 80 two-turn MT-bench questions (the same ones Spec-Bench holds), item categories
  = MT-bench's own eight.
- `humaneval`: the 164 code-completion prompts. `gsm8k`: the 1,319 GSM8K test questions.
- `bfcl`: 800 Berkeley Function-Calling Leaderboard questions (simple_python 400, multiple 200,
  parallel 200); the prompt includes the available functions' docs as JSON.

Subsets: `load_task(name, size)` keeps the items at the evenly spaced positions floor(i·N/size),
i = 0..size−1, of the task's N rows in file order. Evenly spaced rather than the first `size`,
because the files are sorted by category: the first 10 Spec-Bench rows are all "writing", while 60
evenly spaced rows hold 10 of each of the six categories (and 80 BFCL rows hold 40/20/20). The
choice depends only on (N, size), so a subset never changes between runs.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Environment variable naming the folder of normalised JSONL files (read at call time).
DATA_DIR_ENV = "HSPEC_DATA_DIR"
# The command-line flag that overrides the data folder, named in the errors.
DATA_DIR_FLAG = "--data-dir"

SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)

# Task name -> (file in the data folder, the Spec-Bench category it keeps or None for all rows).
_TASK_SOURCES: dict[str, tuple[str, str | None]] = {
    "spec_bench": ("spec_bench.jsonl", None),
    **{c: ("spec_bench.jsonl", c) for c in SPEC_BENCH_CATEGORIES if c != "mt_bench"},
    "mt_bench": ("mt_bench.jsonl", None),
    "humaneval": ("humaneval.jsonl", None),
    "gsm8k": ("gsm8k_test.jsonl", None),
    "bfcl": ("bfcl_subset.jsonl", None),
}
TASK_NAMES: tuple[str, ...] = tuple(_TASK_SOURCES)

# A prompt-only function-calling format (no tool-call API), close to BFCL's own prompting mode:
# the function docs travel as JSON in the user turn and the answer is a list of Python calls.
BFCL_PROMPT_TEMPLATE = (
    "You can call the following functions, described in JSON:\n"
    "{functions}\n\n"
    "Answer the request below with the function call(s) that fulfil it and nothing else, written as "
    "a Python list: [func_name1(param1=value1, param2=value2), func_name2(param=value)].\n\n"
    "Request: {request}"
)


@dataclass(frozen=True)
class EvalItem:
    """One prompt of a task: the user turns of a conversation, answered one after the other."""

    id: str  # unique within its file, prefixed with the set's name, e.g. "spec_bench/81"
    category: str  # reporting group within the task, e.g. "translation" or "writing"
    turns: tuple[str, ...]  # user turns in order; 1 for most tasks, 2 for MT-bench

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.category, str) or not self.category:
            raise ValueError(f"category of {self.id} must be a non-empty string, got {self.category!r}")
        turns = tuple(self.turns) if isinstance(self.turns, (list, tuple)) else self.turns
        if not isinstance(turns, tuple) or not turns:
            raise ValueError(
                f"turns of {self.id} must be a non-empty sequence of strings, got {self.turns!r}"
            )
        for i, turn in enumerate(turns):
            if not isinstance(turn, str) or not turn:
                raise ValueError(f"turn {i} of {self.id} must be a non-empty string, got {turn!r}")
        object.__setattr__(self, "turns", turns)


@dataclass(frozen=True)
class Task:
    """A named, ordered set of evaluation items."""

    name: str  # one of TASK_NAMES for loaded tasks
    items: tuple[EvalItem, ...]  # in file order

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"task name must be a non-empty string, got {self.name!r}")
        items = tuple(self.items) if isinstance(self.items, (list, tuple)) else self.items
        if not isinstance(items, tuple) or not items:
            raise ValueError(f"task {self.name} needs a non-empty sequence of EvalItems, got {self.items!r}")
        for i, item in enumerate(items):
            if not isinstance(item, EvalItem):
                raise ValueError(
                    f"item {i} of task {self.name} must be an EvalItem, got {type(item).__name__}"
                )
        object.__setattr__(self, "items", items)

    def __len__(self) -> int:
        return len(self.items)


def default_data_dir() -> Path:
    """The data shipped with hspec: this package's folder (installed with it as package data)."""
    return Path(__file__).resolve().parent


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The data folder: `data_dir` if given, else $HSPEC_DATA_DIR if set, else `default_data_dir()`.

    Raises FileNotFoundError naming the folder, where its path came from, and how to choose another.
    """
    if data_dir is not None:
        path, origin = Path(data_dir), f"{DATA_DIR_FLAG} / the data_dir argument"
    elif os.environ.get(DATA_DIR_ENV):
        path, origin = Path(os.environ[DATA_DIR_ENV]), f"${DATA_DIR_ENV}"
    else:
        path, origin = default_data_dir(), "the data shipped with hspec; reinstall it"
    if not path.is_dir():
        raise FileNotFoundError(
            f"data folder {path} (from {origin}) does not exist; pass {DATA_DIR_FLAG} DIR (or set "
            f"${DATA_DIR_ENV}) naming a folder that holds spec_bench.jsonl, mt_bench.jsonl, ..., or leave both "
            f"unset to use the data shipped with hspec ({default_data_dir()})"
        )
    return path


def data_file(name: str, data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The file `name` (e.g. "spec_bench.jsonl") in the data folder, or its gzip-compressed `name.gz`.

    Raises FileNotFoundError naming the folder and the flag that chooses another one.
    """
    folder = resolve_data_dir(data_dir)
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"data file {folder / name} (or {name}.gz) does not exist; pass {DATA_DIR_FLAG} DIR "
                            f"naming a folder that holds it")


def load_task(name: str, size: int | None = None, data_dir: str | os.PathLike[str] | None = None) -> Task:
    """Load task `name`, keeping `size` evenly spaced items (all if None or size >= the task's rows).

    Raises ValueError for an unknown name (listing `TASK_NAMES`) or a size < 1, and FileNotFoundError
    naming the missing folder or file.
    """
    _check_name(name)
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"size must be None (all items) or an integer >= 1, got {size!r}")
    file_name, keep_category = _TASK_SOURCES[name]
    path = data_file(file_name, data_dir)
    rows = read_jsonl(path)

    items = [_to_item(name, row, path) for row in rows]
    if keep_category is not None:
        items = [item for item in items if item.category == keep_category]
    if not items:
        raise ValueError(f"task {name} found no items in {path}")
    return Task(name=name, items=tuple(items[i] for i in _evenly_spaced(len(items), size)))


def load_suite(
    names: Iterable[str], size: int | None = None, data_dir: str | os.PathLike[str] | None = None
) -> tuple[Task, ...]:
    """Load several tasks in the given order, each subset to `size` as in `load_task`.

    All names are checked before any file is read, so a typo fails fast.
    """
    names = tuple(names)
    if not names:
        raise ValueError(f"load_suite needs at least one task name; allowed: {', '.join(TASK_NAMES)}")
    for name in names:
        _check_name(name)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"task names must be distinct, got {duplicates} more than once")
    return tuple(load_task(name, size, data_dir) for name in names)


def build_bfcl_prompt(request: str, functions: list[dict[str, Any]]) -> str:
    """The user turn of a BFCL item: the function docs as JSON, then the request."""
    return BFCL_PROMPT_TEMPLATE.format(
        functions=json.dumps(functions, indent=2, ensure_ascii=False), request=request
    )


def _check_name(name: str) -> None:
    if name not in _TASK_SOURCES:
        raise ValueError(f"unknown task {name!r}; allowed: {', '.join(TASK_NAMES)}")


def _evenly_spaced(n: int, size: int | None) -> range | list[int]:
    """Indices floor(i·n/size) for i < size: distinct, in order, spread over the whole range."""
    if size is None or size >= n:
        return range(n)
    return [i * n // size for i in range(size)]


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one per line; a `.gz` file is decompressed first.

    Lines are split on '\\n' only: some strings in the data hold U+2028, which str.splitlines() would
    treat as a line break and cut a record in two. Raises FileNotFoundError or ValueError naming the file
    (and the line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
    rows = []
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{line_number} is not valid JSON: {error}") from error
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_number} must hold a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def _to_item(task: str, row: dict[str, Any], path: Path) -> EvalItem:
    """An EvalItem from one normalised row, with the task's category labels and prompt format."""
    for key in ("id", "category", "turns"):
        if key not in row:
            raise ValueError(f"row {row.get('id', '?')} of {path} lacks the field {key!r}")
    if not isinstance(row["turns"], list) or not row["turns"]:
        raise ValueError(f"row {row['id']} of {path} needs a non-empty 'turns' list, got {row['turns']!r}")
    category, turns = row["category"], list(row["turns"])
    if path.name.startswith("spec_bench.jsonl"):
        # Spec-Bench reports the eight MT-bench categories together as one "mt_bench" category.
        if category in MT_BENCH_CATEGORIES:
            category = "mt_bench"
        if category not in SPEC_BENCH_CATEGORIES:
            raise ValueError(
                f"row {row['id']} of {path} has category {category!r}; expected one of "
                f"{SPEC_BENCH_CATEGORIES + MT_BENCH_CATEGORIES}"
            )
    if task == "bfcl":
        functions = row.get("functions")
        if not isinstance(functions, list) or not functions:
            raise ValueError(
                f"row {row['id']} of {path} needs a non-empty 'functions' list, got {functions!r}"
            )
        # The docs go with the first turn only; a later turn continues the same conversation.
        turns[0] = build_bfcl_prompt(turns[0], functions)
    return EvalItem(id=row["id"], category=category, turns=tuple(turns))
