"""The copies of result tables in the README and the results folders' READMEs are the tables of the committed
result files, line for line (scripts/quote_result_tables.py: what a block holds, and the command that copies
them again), so a table they show was written by the command its file names, never typed by hand or left
behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


quoting = load_script("quote_result_tables")


def test_every_quoted_table_equals_its_result_file():
    blocks = {name: quoting.BLOCK.findall((ROOT / name).read_text()) for name in quoting.QUOTING}
    assert blocks["results/comparison_long/README.md"], "the long comparison's README quotes no result table"
    for name in quoting.QUOTING:
        assert quoting.stale_blocks((ROOT / name).read_text()) == [], \
            f"{name}'s copies differ from their files: run `python scripts/quote_result_tables.py`"


def test_the_block_pattern_finds_a_table_its_section_and_its_end():
    text = "x\n<!-- table from results/a.md#verdicts -->\n| a |\n|---|\n<!-- end of table -->\ny"
    assert [m[1:4] for m in quoting.BLOCK.findall(text)] == [("results/a.md", "verdicts", "| a |\n|---|\n")]
    doc = "# T\n| top |\n## Verdicts\n| v |\n|---|\n## Comparisons\n| c |\n"
    assert quoting.table_lines(doc, "verdicts") == ["| v |", "|---|"]
    assert quoting.table_lines(doc) == ["| top |", "| v |", "|---|", "| c |"]
    with pytest.raises(ValueError, match="anchor 'missing'"):
        quoting.table_lines(doc, "missing")


def test_requoting_copies_a_changed_file_and_leaves_the_rest_of_the_readme(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "a.md").write_text("# A\n\n| x |\n|---|\n| 2 |\n\nnote\n")
    readme = "intro\n<!-- table from results/a.md -->\n| x |\n|---|\n| 1 |\n<!-- end of table -->\nrest\n"
    assert quoting.stale_blocks(readme, tmp_path) == ["results/a.md"]
    fixed = quoting.requote(readme, tmp_path)
    assert fixed == "intro\n<!-- table from results/a.md -->\n| x |\n|---|\n| 2 |\n<!-- end of table -->\nrest\n"
    assert quoting.stale_blocks(fixed, tmp_path) == []
    with pytest.raises(FileNotFoundError, match="results/b.md"):
        quoting.requote(readme.replace("a.md", "b.md"), tmp_path)


def test_github_anchor():
    assert quoting.github_anchor(" The KV pool") == "the-kv-pool"
    assert quoting.github_anchor("DFlash family") == "dflash-family"
    assert quoting.github_anchor("H-Spec") == "h-spec"


def test_every_ci_the_comparison_quotes_from_the_claims_is_in_claims_md():
    """The long comparison's claim-by-claim list types its estimates into prose; each "estimate [low, high]" it
    names must stand in results/comparison_long/claims.md, so the prose cannot keep a number the claims no
    longer give."""
    readme = (ROOT / "results" / "comparison_long" / "README.md").read_text()
    section = readme[readme.index("Claim by claim"):readme.index("The second run's numbers")]
    quoted = re.findall(r"[+-]\d+\.\d%? \[[+-]\d+\.\d%?, [+-]\d+\.\d%?\]", section)
    claims = (ROOT / "results" / "comparison_long" / "claims.md").read_text()
    assert quoted, "the comparison's claim-by-claim list quotes no CI"
    missing = [ci for ci in quoted if ci not in claims]
    assert not missing, f"results/comparison_long/README.md quotes CIs that claims.md does not give: {missing}"


HEADLINE = re.compile(r"<!-- headline: .*? -->\n(.*?)<!-- end of headline -->", re.S)
NUMBER = re.compile(r"(?<![\w.:])\d[\d,]*(?:\.\d+)?")  # not the digits of a name: bf16, w4a8, AVX512, hspec:0.4


def numbers(text: str) -> set[str]:
    """The numbers written in `text`, thousands separators dropped: '2,560 rows, 1.70x' -> {'2560', '1.70'}."""
    return {n.replace(",", "").rstrip(".") for n in NUMBER.findall(text)}


def test_numbers_finds_figures_and_leaves_names():
    assert numbers("tau 2.10, 1.70x; 3,840 B/token; 40-53 tokens") == {"2.10", "1.70", "3840", "40", "53"}
    assert numbers("bf16 w4a8 AVX512-VNNI hspec+ngram:0.4 SmolLM2") == set()


def test_every_number_of_the_readme_headline_stands_in_the_files_its_row_names():
    """The README's headline table (at most 8 rows, on its first screen) types its numbers by hand; each one must
    be written in one of the results files its row names, so no figure comes from nowhere or outlives a rerun."""
    readme = (ROOT / "README.md").read_text()
    block = HEADLINE.search(readme)
    assert block, "the README has no headline table between its markers"
    assert readme[:block.end()].count("\n") < 80, "the headline table must end within the README's first 80 lines"
    rows = [line for line in block[1].splitlines() if line.startswith("|")][2:]  # header and rule dropped
    assert 1 <= len(rows) <= 8, f"the headline table has {len(rows)} rows; at most 8"
    for row in rows:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        files = re.findall(r"`(results/[^`]+)`", cells[-1])
        assert files and all((ROOT / f).is_file() for f in files), f"a headline row names no results file: {row}"
        written = set().union(*(numbers((ROOT / f).read_text()) for f in files))
        missing = numbers(" ".join(cells[:-1])) - written
        assert not missing, f"{cells[0]!r}: {sorted(missing)} not written in {files}"
