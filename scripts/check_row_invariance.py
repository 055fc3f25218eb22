"""Does this CPU give every verify row the bits of its 1-token decode? (docs/fast-path.md)

Greedy speculative decoding in bf16, int8 or int4 is lossless only if the target computes a token's logits to
the same bits alone (a decode) and as one row of a (K+1)-token verify. That is a property of the kernels
torch and oneDNN pick on a given CPU (an AMX Xeon picks others than an AMD EPYC), so run this on a new
kind of machine before trusting `--dtype auto`: it decodes Spec-Bench answers one token at a time, then
recomputes the same tokens in T-token forwards starting at every position, and counts the rows whose
logits differ in any bit, and among them those whose argmax differs (a greedy output would change).

    .venv/bin/python scripts/check_row_invariance.py [--dtypes bfloat16,int8,int4] [--items 2] [--tokens 96]

Writes results/row_invariance/row_invariance.{json,md}, named after no host: rerun it on each machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from hspec.bench.decode import row_differences
from hspec.data.tasks import load_task
from hspec.machine import cpu_flags
from hspec.models.loading import load_target
from hspec.provenance import provenance, provenance_markdown, write_results

# /proc/cpuinfo flags that decide which matrix kernels oneDNN picks (recorded with the result).
_MATRIX_FLAGS = ("amx", "avx512_bf16", "avx512_vnni", "avx_vnni")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,int8,int4",
                        help="comma-separated: bfloat16, int8, int4 (default all three)")
    parser.add_argument("--items", type=int, default=2, help="Spec-Bench items, evenly spaced (default 2)")
    parser.add_argument("--tokens", type=int, default=96, help="greedy tokens decoded per item (default 96)")
    parser.add_argument("--widths", default="2,4,8,16", help="verify widths T (default 2,4,8,16)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--out", type=Path, default=Path("results/row_invariance"))
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    if args.tokens <= max(widths) or min(widths) < 2:
        parser.error(f"--widths must be >= 2 and below --tokens ({args.tokens}); got {args.widths}")
    torch.set_num_threads(args.threads)
    items = load_task("spec_bench", args.items).items
    results = {}
    with torch.inference_mode():
        for dtype in args.dtypes.split(","):
            target = load_target("smollm2", dtype=dtype)
            totals = {w: {"rows": 0, "differ": 0, "argmax_differ": 0} for w in widths}
            for item in tqdm(items, desc=dtype, unit="item"):
                prompt = target.tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}])
                per_width = row_differences(target.model, prompt, args.tokens, widths, every_start=True)
                for width, c in per_width.items():  # this file's names for the bench's counts
                    totals[width]["rows"] += c["positions"]
                    totals[width]["differ"] += c["logits_differ"]
                    totals[width]["argmax_differ"] += c["differ"]
            results[dtype] = totals
    command = "python scripts/check_row_invariance.py " + " ".join(sys.argv[1:] if argv is None else argv)
    matrix_flags = sorted(flag for flag in cpu_flags() if flag.startswith(_MATRIX_FLAGS))
    meta = provenance(command.strip(), {"target": "SmolLM2-135M-Instruct", "dtypes": args.dtypes,
                                        "items": [i.id for i in items], "tokens": args.tokens, "widths": widths,
                                        "threads": args.threads,
                                        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                        "cpu_matrix_flags": matrix_flags})
    lines = ["# Verify rows against their 1-token decode, bit for bit", "", provenance_markdown(meta), "",
             "| dtype | T | rows | logits differ | argmax differs |", "|---|---|---|---|---|"]
    for dtype, totals in results.items():
        for width, c in totals.items():
            lines.append(f"| {dtype} | {width} | {c['rows']} | {c['differ']} | {c['argmax_differ']} |")
    lines += ["", "Every row must be 0: a differing row means greedy speculative decoding in that dtype may part "
              "from plain greedy decoding on this CPU (docs/fast-path.md).", ""]
    json_path, md_path = write_results(args.out, "row_invariance", {"provenance": meta, "results": results},
                                       "\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {json_path} and {md_path}")
    return 0 if all(c["differ"] == 0 for totals in results.values() for c in totals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
