"""The README's copies of result tables are the tables of the committed result files, line for line.

A block of the README between `<!-- table from results/PATH.md -->` and `<!-- end of table -->` must
hold exactly the markdown table lines (those starting with "|") of results/PATH.md, so a table the
README shows was written by the command that file names, never typed by hand or left behind.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- table from (\S+\.md) -->\n(.*?)<!-- end of table -->", re.S)


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_every_table_block_of_the_readme_equals_its_result_file():
    blocks = BLOCK.findall((ROOT / "README.md").read_text())
    assert blocks, "the README quotes no result table (expected at least results/comparison_long/eval_table.md)"
    for path, body in blocks:
        source = ROOT / path
        assert source.is_file(), f"the README quotes a table from {path}, which does not exist"
        assert table_lines(body) == table_lines(source.read_text()), \
            f"the README's copy of {path} differs from the file: copy its table lines again"
        assert body.strip() and all(line.startswith("|") for line in body.strip().splitlines()), \
            f"the README's block for {path} holds lines that are not its table"


def test_the_block_pattern_finds_a_table_and_its_end():
    text = "x\n<!-- table from results/a.md -->\n| a |\n|---|\n<!-- end of table -->\ny"
    assert BLOCK.findall(text) == [("results/a.md", "| a |\n|---|\n")]
