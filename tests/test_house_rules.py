"""Rules of the house read off the code's text: no Python file over 600 lines, and no drafter kind tested
by name outside `drafters/` (what a kind can do is a capability its class declares, docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "hspec"
MAX_LINES = 600


def test_no_python_file_is_over_600_lines():
    files = [p for folder in ("src", "tests", "scripts") for p in (ROOT / folder).rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert files and not long, f"split these along their ideas: {long}"


def _strings(node: ast.expr) -> set[str]:
    """The string constants `node` is, or holds as a tuple, list or set display."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def kind_name_tests(source: str, kinds: set[str]) -> list[str]:
    """Each comparison in `source` (==, !=, in, not in) with a registered kind's name as a literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            named = set().union(*(_strings(side) for side in (node.left, *node.comparators))) & kinds
            if named:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_kind_name_check_sees_the_ways_a_name_is_tested():
    kinds = {"dflash", "dels", "none"}
    source = ('a = kind == "dflash"\nb = (kind, info.kind) == ("dels", "dflash")\nc = m.kind in {"none", "x"}\n'
              'd = name == "other"\ne = PLAIN != label\n')
    assert [f.split(":")[0] for f in kind_name_tests(source, kinds)] == ["line 1", "line 2", "line 3"]


def test_no_kind_name_is_tested_outside_drafters():
    from hspec.drafters import DRAFTERS

    kinds = set(DRAFTERS.names())
    found = {str(p.relative_to(SRC)): hits for p in sorted(SRC.rglob("*.py"))
             if "drafters" not in p.relative_to(SRC).parts and (hits := kind_name_tests(p.read_text(), kinds))}
    assert not found, f"declare a capability on the drafter class instead: {found}"
