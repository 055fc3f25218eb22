"""AMX-INT8 tiles against the AVX512-VNNI wide tiles for the w4a8 and w8a8 products of 1-16 rows.

Builds `scripts/amx_tiles_probe.cpp` (a stand-alone C++ probe, not part of hspec: the VNNI tiles of
models/cpu_kernels.cpp and AMX forms of the same products, which must give their bits) with g++ -O3, runs it
(one thread; per shape and row count the kernels' calls alternate round by round, each call's thread CPU time,
medians) and writes <out>/amx_tiles_probe.{json,md} with the provenance. Needs a CPU with AMX-INT8 and
AVX512-VNNI and a Linux kernel that grants the tile state (5.16 or newer).

    .venv/bin/python scripts/amx_tiles_probe.py [--rounds 201] [--out results/native_drafter/amx_tiles]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from hspec.provenance import provenance, provenance_markdown, write_results

SOURCE = Path(__file__).with_name("amx_tiles_probe.cpp")
# Columns of the table: (JSON key without _us, heading); the AMX forms' speedups are against their VNNI tile.
COLUMNS = [("w4a8_vnni", "w4a8 VNNI"), ("w4a8_amx", "w4a8 AMX"), ("w4a8_amx_p2", "w4a8 AMX, steps of 2 pairs"),
           ("w4a8_amx_vector_only", "w4a8 AMX without its tile instructions"),
           ("w4a8_amx_tiles_apart", "w4a8 AMX, tile instructions on buffers apart"),
           ("w8a8_vnni", "w8a8 VNNI"), ("w8a8_amx", "w8a8 AMX"), ("w8a8_amx_p2", "w8a8 AMX, steps of 2 pairs"),
           ("w8a8_amx_direct", "w8a8 AMX, B tiles in place"), ("tile_ops", "tile instructions alone"),
           ("tdp_only", "tdpbsud alone")]
SHAPE_NAMES = {(1536, 576): "gate/up (1536 x 576)", (576, 1536): "down (576 x 1536)",
               (8192, 576): "pruned head (8192 x 576)"}


def run_probe(rounds: int) -> list[dict]:
    """The probe's rows (one JSON object per shape and row count), built in a temporary directory."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise SystemExit("the probe needs g++")
    with tempfile.TemporaryDirectory() as workdir:
        binary = Path(workdir) / "amx_tiles_probe"
        subprocess.run([compiler, "-O3", "-o", str(binary), str(SOURCE)], check=True)
        done = subprocess.run([str(binary), str(rounds)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the probe failed: {done.stderr.strip()}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def markdown(payload: dict) -> str:
    lines = ["# AMX-INT8 against the AVX512-VNNI tiles: w4a8 and w8a8 products of 1-16 rows\n",
             provenance_markdown(payload["provenance"]),
             "\nMedian thread CPU time of one product over all N outputs (us), one thread, the kernels' calls "
             "alternating round by round in one process (fp32 outputs, weights hot in the caches). An AMX "
             "column's ratio is the VNNI tile's time over its own (above 1: AMX faster); every AMX output equal "
             "to the VNNI tile's bit for bit unless marked. 16 rows run as two tiles of 8 rows, as hspec's "
             "products do. `tile instructions alone`: the AMX forms' tilezero, two tile loads, tdpbsud and "
             "tile store per pair of blocks, as many as one call issues, without the vector work; `tdpbsud "
             "alone`: as many tdpbsud; `without its tile instructions` and `tile instructions on buffers apart` "
             "(timing only, their outputs wrong): w4a8 AMX's vector work alone, and with its tile instructions "
             "on buffers no vector instruction touches. See README.md.\n",
             "| shape | rows | " + " | ".join(heading for _, heading in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for r in payload["results"]:
        cells = []
        for key, _ in COLUMNS:
            us = r[f"{key}_us"]
            reference = f"{key.split('_')[0]}_vnni"
            if f"{key}_same_bits" in r:
                same = "" if r[f"{key}_same_bits"] else " BITS DIFFER"
                cells.append(f"{us:.1f} ({r[f'{reference}_us'] / us:.2f}x){same}")
            else:
                cells.append(f"{us:.1f}")
        name = SHAPE_NAMES.get((r["N"], r["K"]), f"{r['N']} x {r['K']}")
        lines.append(f"| {name} | {r['rows']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=201, help="timed calls per kernel, shape and rows (default 201)")
    p.add_argument("--out", type=Path, default=Path("results/native_drafter/amx_tiles"))
    args = p.parse_args()
    load = os.getloadavg()
    rows = run_probe(args.rounds)
    command = f"python scripts/amx_tiles_probe.py --rounds {args.rounds} --out {args.out}"
    settings = {"rounds": args.rounds, "threads": 1, "compiler": "g++ -O3",
                "load_average_before": " ".join(f"{x:.2f}" for x in load),
                "load_average_after": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    payload = {"provenance": provenance(command, settings), "results": rows}
    write_results(args.out, "amx_tiles_probe", payload, markdown(payload))
    print(markdown(payload))
    same = all(r[key] for r in rows for key in r if key.endswith("_same_bits"))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
