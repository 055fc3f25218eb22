"""Task suites over the data shipped in hspec/data, plus a tiny hand-written data folder."""

import gzip
import json
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest

from hspec.data.tasks import (
    DATA_DIR_ENV,
    MT_BENCH_CATEGORIES,
    SPEC_BENCH_CATEGORIES,
    TASK_NAMES,
    EvalItem,
    Task,
    data_file,
    default_data_dir,
    load_suite,
    load_task,
    resolve_data_dir,
)

FULL_SIZES = {
    "spec_bench": 480,
    "translation": 80,
    "summarization": 80,
    "qa": 80,
    "math_reasoning": 80,
    "rag": 80,
    "mt_bench": 80,
    "humaneval": 164,
    "gsm8k": 1319,
    "bfcl": 800,
}

@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    # The shipped folder is what these tests check; an outer $HSPEC_DATA_DIR must not redirect them.
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)


def test_task_names_cover_the_suites():
    assert set(TASK_NAMES) == set(FULL_SIZES)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_each_task_loads_in_full(name):
    task = load_task(name)
    assert task.name == name
    assert len(task) == FULL_SIZES[name]
    assert len({item.id for item in task.items}) == len(task)
    if name in SPEC_BENCH_CATEGORIES and name != "mt_bench":  # mt_bench keeps its own 8
        assert {item.category for item in task.items} == {name}


@pytest.mark.parametrize("name", TASK_NAMES)
def test_sizes_respected_and_deterministic(name):
    task = load_task(name, size=7)
    assert len(task) == 7
    assert load_task(name, size=7) == task
    full_ids = [item.id for item in load_task(name).items]
    positions = [full_ids.index(item.id) for item in task.items]
    assert positions == sorted(positions)  # file order kept
    assert positions[0] == 0


def test_size_larger_than_task_gives_all_items():
    assert len(load_task("mt_bench", size=1000)) == 80


def test_spec_bench_subset_is_balanced_over_categories():
    task = load_task("spec_bench", size=60)
    counts = {c: sum(item.category == c for item in task.items) for c in SPEC_BENCH_CATEGORIES}
    assert counts == dict.fromkeys(SPEC_BENCH_CATEGORIES, 10)


def test_mt_bench_is_two_turn():
    task = load_task("mt_bench")
    assert all(len(item.turns) == 2 for item in task.items)
    assert {item.category for item in task.items} == set(MT_BENCH_CATEGORIES)
    spec_mt = [item for item in load_task("spec_bench").items if item.category == "mt_bench"]
    assert [item.turns for item in spec_mt] == [item.turns for item in task.items]


def test_bfcl_prompt_carries_function_docs():
    item = load_task("bfcl", size=1).items[0]
    assert item.id == "simple_python_0"
    assert "calculate_triangle_area" in item.turns[0]
    assert '"required"' in item.turns[0]  # the JSON schema, not only the name
    request = "Find the area of a triangle with a base of 10 units and height of 5 units."
    assert item.turns[0].endswith(request)


def test_load_suite():
    suite = load_suite(["gsm8k", "humaneval"], size=5)
    assert [task.name for task in suite] == ["gsm8k", "humaneval"]
    assert [len(task) for task in suite] == [5, 5]


def test_unknown_task_lists_allowed_names():
    with pytest.raises(ValueError, match="unknown task 'nope'.*spec_bench.*bfcl"):
        load_task("nope")
    with pytest.raises(ValueError, match="unknown task"):
        load_suite(["gsm8k", "nope"])
    with pytest.raises(ValueError, match="distinct"):
        load_suite(["gsm8k", "gsm8k"])


@pytest.mark.parametrize("size", [0, -3, 2.5, True])
def test_bad_size(size):
    with pytest.raises(ValueError, match="size"):
        load_task("gsm8k", size=size)


def test_missing_folder_names_its_path(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_task("gsm8k", data_dir=missing)
    monkeypatch.setenv(DATA_DIR_ENV, str(missing))
    with pytest.raises(FileNotFoundError, match=rf"nowhere.*\${DATA_DIR_ENV}"):
        load_task("gsm8k")
    with pytest.raises(FileNotFoundError, match=r"nowhere.*--data-dir"):  # the flag that chooses another
        resolve_data_dir(missing)
    monkeypatch.delenv(DATA_DIR_ENV)
    with pytest.raises(FileNotFoundError, match=r"humaneval.jsonl.*--data-dir"):  # a folder without the file
        load_task("humaneval", data_dir=tmp_path)


def test_the_data_ships_inside_the_package():
    """The default folder is hspec/data itself, and pyproject's package-data installs every file in it."""
    import hspec

    shipped = default_data_dir()
    assert shipped == Path(hspec.__file__).resolve().parent / "data" and resolve_data_dir() == shipped
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    section = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    patterns = re.findall(r'"([^"]+)"', section)
    files = [p.relative_to(shipped.parent).as_posix() for p in shipped.rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert not [f for f in files if not any(fnmatch(f, pattern) for pattern in patterns)]
    readme = (shipped / "README.md").read_text()
    for f in files:  # every data file and licence text is named in the README
        if f != "data/README.md":
            assert Path(f).name.split(".")[0] in readme, f


def test_the_shipped_training_prompts_read_back(tmp_path):
    from hspec.training.datagen import DataGenSettings, prompts_path, read_prompts

    rows = read_prompts(prompts_path(DataGenSettings()))  # `hspec data generate`'s default prompts
    assert len(rows) == 15346 and len({row["id"] for row in rows}) == len(rows)
    assert all(isinstance(row["turns"][0], str) and row["turns"][0] for row in rows)
    own = tmp_path / "train_prompts.jsonl"  # --data-dir chooses another folder's prompts
    own.write_text(json.dumps({"id": "mine/0", "category": "c", "turns": ["Say hi."]}) + "\n")
    assert read_prompts(prompts_path(DataGenSettings(data_dir=str(tmp_path)))) == [json.loads(own.read_text())]


def test_a_gzip_file_stands_for_the_plain_one(tmp_path):
    rows = [{"id": f"humaneval/{i}", "category": "humaneval", "turns": [f"def f{i}():"]} for i in range(3)]
    with gzip.open(tmp_path / "humaneval.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    assert data_file("humaneval.jsonl", tmp_path) == tmp_path / "humaneval.jsonl.gz"
    assert [item.turns for item in load_task("humaneval", data_dir=tmp_path).items] == [(r["turns"][0],) for r in rows]
    assert data_file("train_prompts.jsonl").name == "train_prompts.jsonl.gz"  # shipped compressed


def test_env_var_read_at_call_time(tmp_path, monkeypatch):
    # U+2028 inside a string must not split the record: lines are split on "\n" only.
    rows = [
        {"id": "gsm8k_test/0", "category": "gsm8k", "turns": ["first\u2028line"]},
        {"id": "gsm8k_test/1", "category": "gsm8k", "turns": ["second"]},
        {"id": "gsm8k_test/2", "category": "gsm8k", "turns": ["third"]},
    ]
    text = "\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n"
    (tmp_path / "gsm8k_test.jsonl").write_text(text, encoding="utf-8")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    task = load_task("gsm8k")
    assert [item.turns for item in task.items] == [("first\u2028line",), ("second",), ("third",)]
    assert [item.id for item in load_task("gsm8k", size=2).items] == ["gsm8k_test/0", "gsm8k_test/1"]


def test_malformed_line_names_file_and_line(tmp_path):
    (tmp_path / "humaneval.jsonl").write_text('{"id": "a", "category": "c", "turns": ["x"]}\n{oops\n')
    with pytest.raises(ValueError, match=r"humaneval.jsonl:2"):
        load_task("humaneval", data_dir=tmp_path)


def test_item_and_task_validation():
    with pytest.raises(ValueError, match="turns of q"):
        EvalItem(id="q", category="c", turns=())
    with pytest.raises(ValueError, match="turn 1 of q"):
        EvalItem(id="q", category="c", turns=("a", ""))
    assert EvalItem(id="q", category="c", turns=["a", "b"]).turns == ("a", "b")
    with pytest.raises(ValueError, match="non-empty"):
        Task(name="t", items=())
