"""Decode ms per generated token of each method in `hspec eval` results files (docs/fast-path.md).

`hspec eval` reports tau and speedups over plain decoding; the absolute time per token, which compares
runs of different dtypes and K, is its records' decode seconds over their tokens (prefill excluded):

    .venv/bin/python scripts/eval_ms_per_token.py results/fast_path_amx/eval_spec_bench_k*_greedy_*.json \
        --out results/fast_path_amx

Writes <out>/eval_ms_per_token.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from hspec.provenance import provenance, provenance_markdown, write_results


def ms_per_token(path: Path) -> dict[str, float]:
    """Per method of one eval JSON: 1,000 x its records' decode seconds / their generated tokens."""
    seconds, tokens = Counter(), Counter()
    for record in json.loads(path.read_text())["records"]:
        seconds[record["method"]] += record["decode_s"]
        tokens[record["method"]] += record["tokens"]
    return {method: 1000 * seconds[method] / tokens[method] for method in tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("evals", nargs="+", type=Path, help="hspec eval JSON files")
    parser.add_argument("--out", type=Path, required=True, help="folder for eval_ms_per_token.{json,md}")
    args = parser.parse_args(argv)
    runs = {path.stem: ms_per_token(path) for path in sorted(args.evals)}
    command = "python scripts/eval_ms_per_token.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = provenance(command, {"evals": [str(p) for p in sorted(args.evals)]})
    methods = list(dict.fromkeys(m for per_method in runs.values() for m in per_method))
    lines = ["# Decode ms per generated token in each evaluation run (prefill excluded)", "",
             provenance_markdown(meta), "",
             "Each run's own commit, machine and settings are in its file; timings come from that run.", "",
             "| run | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for name, per_method in runs.items():
        cells = [f"{per_method[m]:.1f}" if m in per_method else "–" for m in methods]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    json_path, md_path = write_results(args.out, "eval_ms_per_token", {"provenance": meta, "runs": runs},
                                       "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
