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
