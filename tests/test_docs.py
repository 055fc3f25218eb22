"""No reference into the docs dangles: every `docs/NAME.md#anchor` (or `docs/guide/NAME.md#anchor`) cited in
the code, the tests, the scripts, the README, the docs or the results folders' READMEs names a heading of that
file, every markdown link between them leads to a file and heading that exist, and nothing cites a design file
that is not in the repository."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
DOCS = ROOT / "docs"
CITED = re.compile(r"docs/([\w/-]+)\.md#([a-z0-9-]+)")


github_anchor = load_script("quote_result_tables").github_anchor  # the one place the anchor rule is written


def anchors(doc: Path = DESIGN) -> set[str]:
    headings = [line.lstrip("#") for line in doc.read_text().splitlines() if re.match(r"#{1,6} ", line)]
    return {github_anchor(h) for h in headings}


def markdown() -> list[Path]:
    """The README, every page of docs/ (the guide included) and the results folders' READMEs."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), *sorted(ROOT.joinpath("results").rglob("README.md"))]


def sources() -> list[Path]:
    files = [*ROOT.joinpath("src").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py"),
             *ROOT.joinpath("scripts").rglob("*"), *markdown()]
    this = Path(__file__).resolve()  # names the patterns it looks for
    return [f for f in files if f.is_file() and f.suffix in (".py", ".sh", ".md", "") and f.resolve() != this]


def test_every_cited_anchor_exists():
    known = {str(doc.relative_to(DOCS).with_suffix("")): anchors(doc) for doc in DOCS.rglob("*.md")}
    dangling = [f"{path.relative_to(ROOT)}: docs/{name}.md#{anchor}" for path in sources()
                for name, anchor in CITED.findall(path.read_text(errors="replace"))
                if anchor not in known.get(name, set())]
    assert not dangling, f"references to missing headings of the docs: {dangling}"


def test_in_page_links_exist():
    known = anchors()
    missing = [a for a in re.findall(r"\]\(#([a-z0-9-]+)\)", DESIGN.read_text()) if a not in known]
    assert not missing, f"docs/design.md links to missing headings: {missing}"


def test_links_between_docs_exist():
    """`[text](path.md#anchor)` in the README, docs/ or a results folder's README names a file that exists, from
    the linking file's folder, and one of its headings."""
    broken = []
    for doc in markdown():
        for target, anchor in re.findall(r"\]\(([\w./-]+\.md)(?:#([a-z0-9-]+))?\)", doc.read_text()):
            other = doc.parent / target
            if not other.exists() or (anchor and anchor not in anchors(other)):
                broken.append(f"{doc.relative_to(ROOT)} -> {target}#{anchor}")
    assert not broken, f"links between docs that lead nowhere: {broken}"


def test_no_reference_to_a_design_file_outside_the_repository():
    stale = [str(path.relative_to(ROOT)) for path in sources() if "DESIGN.md" in path.read_text(errors="replace")]
    assert not stale, f"these cite DESIGN.md, which is not in the repository; cite docs/design.md#...: {stale}"
