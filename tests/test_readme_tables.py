"""The README's copies of result tables are the tables of the committed result files, line for line.

A block of the README between `<!-- table from results/PATH.md -->` and `<!-- end of table -->` must
hold exactly the markdown table lines (those starting with "|") of results/PATH.md; with
`results/PATH.md#heading`, those under that heading of the file (up to its next heading). So a table
the README shows was written by the command that file names, never typed by hand or left behind.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_docs import github_anchor

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- table from (\S+\.md)(?:#([\w-]+))? -->\n(.*?)<!-- end of table -->", re.S)


def table_lines(text: str, heading: str = "") -> list[str]:
    """The lines of `text` that are table rows; with `heading`, only those in that section (its anchor)."""
    if heading:
        sections = re.split(r"^#+ (.*)$", text, flags=re.M)  # [preamble, title, body, title, body, ...]
        bodies = [body for title, body in zip(sections[1::2], sections[2::2]) if github_anchor(title) == heading]
        assert bodies, f"no heading with the anchor '{heading}'"
        text = bodies[0]
    return [line for line in text.splitlines() if line.startswith("|")]


def test_every_table_block_of_the_readme_equals_its_result_file():
    blocks = BLOCK.findall((ROOT / "README.md").read_text())
    assert blocks, "the README quotes no result table (expected at least results/comparison_long/eval_table.md)"
    for path, heading, body in blocks:
        source = ROOT / path
        where = f"{path}#{heading}" if heading else path
        assert source.is_file(), f"the README quotes a table from {path}, which does not exist"
        assert table_lines(body) == table_lines(source.read_text(), heading), \
            f"the README's copy of {where} differs from the file: copy its table lines again"
        assert body.strip() and all(line.startswith("|") for line in body.strip().splitlines()), \
            f"the README's block for {where} holds lines that are not its table"


def test_the_block_pattern_finds_a_table_its_section_and_its_end():
    text = "x\n<!-- table from results/a.md#verdicts -->\n| a |\n|---|\n<!-- end of table -->\ny"
    assert BLOCK.findall(text) == [("results/a.md", "verdicts", "| a |\n|---|\n")]
    doc = "# T\n| top |\n## Verdicts\n| v |\n|---|\n## Comparisons\n| c |\n"
    assert table_lines(doc, "verdicts") == ["| v |", "|---|"]
    assert table_lines(doc) == ["| top |", "| v |", "|---|", "| c |"]
