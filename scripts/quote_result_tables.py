"""Copy the result tables the README and the results folders' READMEs quote from their files again.

A block of such a file between `<!-- table from results/PATH.md -->` and `<!-- end of table -->` holds
exactly the markdown table lines (those starting with "|") of results/PATH.md (a path from the repository's
root); with `results/PATH.md#heading`, those under that heading of the file (up to its next heading). After a
command rewrites such a file, `python scripts/quote_result_tables.py` puts its table lines into every quoting
file (`QUOTING`) again; `--check` only names the blocks that differ (exit status 1).
tests/test_readme_tables.py runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The files that quote result tables, from the repository's root: the long comparison's tables and verdicts are
# quoted in its folder's README, the attention's before and after in its.
QUOTING = ("README.md", "results/comparison_long/README.md", "results/attention_scaling/README.md",
           "results/adaptive_length/README.md")
BLOCK = re.compile(r"(<!-- table from (\S+\.md)(?:#([\w-]+))? -->\n)(.*?)(<!-- end of table -->)", re.S)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def table_lines(text: str, heading: str = "") -> list[str]:
    """The lines of `text` that are table rows; with `heading`, only those in that section (its anchor).

    Raises ValueError when no heading of `text` has that anchor.
    """
    if heading:
        sections = re.split(r"^#+ (.*)$", text, flags=re.M)  # [preamble, title, body, title, body, ...]
        bodies = [body for title, body in zip(sections[1::2], sections[2::2]) if github_anchor(title) == heading]
        if not bodies:
            raise ValueError(f"no heading with the anchor '{heading}'")
        text = bodies[0]
    return [line for line in text.splitlines() if line.startswith("|")]


def stale_blocks(readme: str, root: Path = ROOT) -> list[str]:
    """`PATH[#heading]` of every block of `readme` whose lines are not its file's table lines."""
    stale = []
    for _, path, heading, body, _ in BLOCK.findall(readme):
        source = root / path
        if not source.is_file() or table_lines(body) != table_lines(source.read_text(), heading) or \
                not all(line.startswith("|") for line in body.strip().splitlines()):
            stale.append(f"{path}#{heading}" if heading else path)
    return stale


def requote(readme: str, root: Path = ROOT) -> str:
    """`readme` with every block's lines replaced by its file's table lines.

    Raises FileNotFoundError naming a quoted file that does not exist.
    """
    def fill(match: re.Match) -> str:
        opening, path, heading, _, closing = match.groups()
        source = root / path
        if not source.is_file():
            raise FileNotFoundError(f"the README quotes a table from {path}, which does not exist")
        return opening + "\n".join(table_lines(source.read_text(), heading or "")) + "\n" + closing

    return BLOCK.sub(fill, readme)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=Path, action="append",
                        help="a file to update (repeatable; default: every file of QUOTING)")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the folder the quoted paths start from (default: the repository)")
    parser.add_argument("--check", action="store_true", help="only name the blocks that differ from their files")
    args = parser.parse_args(argv)
    status = 0
    for readme in args.readme or [ROOT / name for name in QUOTING]:
        text = readme.read_text()
        stale = stale_blocks(text, args.root)
        if args.check:
            for where in stale:
                print(f"{readme}: differs from its file: {where}")
            status |= 1 if stale else 0
            continue
        if stale:
            readme.write_text(requote(text, args.root))
        named = f": {', '.join(stale)}" if stale else ""
        print(f"{readme}: {len(stale)} of {len(BLOCK.findall(text))} quoted tables copied again{named}")
    return status


if __name__ == "__main__":
    sys.exit(main())
