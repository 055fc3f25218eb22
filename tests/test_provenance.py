"""Provenance says which commit made a result and, explicitly, whether the tree was dirty."""

from __future__ import annotations

from hspec.provenance import provenance, provenance_markdown


def test_provenance_records_tree_state_consistently():
    meta = provenance("hspec test", {"K": 7})
    assert meta["tree_dirty"] in (True, False, None)
    assert meta["commit"].endswith("-dirty") == bool(meta["tree_dirty"])
    assert (meta["commit"] == "unknown") == (meta["tree_dirty"] is None)


def test_markdown_has_a_line_for_a_dirty_tree():
    meta = provenance("hspec test", {"K": 7})
    dirty = {**meta, "commit": "abc1234-dirty", "tree_dirty": True}
    clean = {**meta, "commit": "abc1234", "tree_dirty": False}
    assert "- tree_dirty: true (" in provenance_markdown(dirty)
    assert "- tree_dirty: false\n" in provenance_markdown(clean)
    older = {k: v for k, v in dirty.items() if k != "tree_dirty"}  # files written before the field existed
    assert "- tree_dirty: true (" in provenance_markdown(older)
    assert "tree_dirty" not in provenance_markdown({**older, "commit": "abc1234"})
    unknown = {**meta, "commit": "unknown", "tree_dirty": None}
    assert "tree_dirty" not in provenance_markdown(unknown)
    assert "commits" not in provenance_markdown(meta)
    resumed = provenance_markdown({**meta, "commits": ["abc1234", "def5678"]})
    assert "- commits: abc1234, def5678 (a resumed run" in resumed


def test_only_files_outside_results_make_the_tree_dirty(tmp_path):
    import subprocess

    from hspec.provenance import _git_state

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "results").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "results" / "r.md").write_text("old")
    (tmp_path / "src" / "code.py").write_text("old")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "first")
    assert _git_state(tmp_path / "src")[1] is False
    (tmp_path / "results" / "r.md").write_text("new result")
    commit, dirty = _git_state(tmp_path / "src")
    assert dirty is False and not commit.endswith("-dirty")
    (tmp_path / "src" / "code.py").write_text("changed")
    commit, dirty = _git_state(tmp_path / "src")
    assert dirty is True and commit.endswith("-dirty")
