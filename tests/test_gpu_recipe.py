"""scripts/gpu_recipe.sh end to end on the CPU at toy sizes, so that its plumbing is checked before a GPU's
minutes are spent on it: the throughput bench, the responses generated in batches, the recipe continuing the
shipped drafter on a corpus and the new responses, the export, and the outputs cut into pieces that join again
into files with the sums it recorded. Runs with `-m slow` (the real SmolLM2 target, a few minutes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIECE = 4 << 20  # bytes: small enough that the drafter's weights come in several pieces


@pytest.mark.slow
def test_the_gpu_recipe_runs_on_a_cpu_at_toy_sizes_and_its_pieces_join_into_its_files(tmp_path):
    from hspec.training.run import is_validation

    lines = (ROOT / "results/train_data/corpus_part1.jsonl").read_text().splitlines()
    held_out = [line for line in lines if is_validation(json.loads(line)["id"])][:2]  # what validation reads
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join([*lines[:10], *held_out]) + "\n")
    work = tmp_path / "work"
    env = {**os.environ, "DEVICE": "cpu", "COMPILE": "0", "TESTS": "0", "BENCH_BLOCKS": "128",
           "BENCH_PRECISION": "fp32", "SEQS": "4", "ANCHORS": "16", "STEPS": "2", "NUM_PROMPTS": "2",
           "GEN_BATCH": "2", "GEN_SECONDS": "300",
           "CORPORA": str(corpus), "PIECE": str(PIECE), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts/gpu_recipe.sh"), str(work)], env=env, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "failed" not in done.stdout.lower(), done.stdout
    assert "[gpu] 2 new responses" in done.stdout

    out = work / "out"
    pieces = sorted(p for p in out.iterdir() if ".part" in p.name)
    assert pieces and all(p.stat().st_size <= PIECE for p in pieces)
    assert len([p for p in pieces if p.name.startswith("drafter_model.safetensors.part")]) > 1
    joined = subprocess.run(["bash", "JOIN"], cwd=out, capture_output=True, text=True)
    assert joined.returncode == 0, joined.stdout + joined.stderr  # its last line checks every sum
    for name in ("drafter_model.safetensors", "drafter_config.json", "corpus_gpu.jsonl", "history.jsonl",
                 "results_train_throughput_gpu.md", "results_train.log"):
        assert (out / name).is_file(), name

    assert len((out / "corpus_gpu.jsonl").read_text().splitlines()) == 2
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history if row["event"] == "step"] == [0, 1]
    from hspec.models.loading import load_target
    from hspec.runtime import build_drafter

    export = tmp_path / "drafter"
    export.mkdir()
    for name in ("model.safetensors", "config.json"):
        (export / name).write_bytes((out / f"drafter_{name}").read_bytes())
    assert build_drafter("hspec", load_target(None), path=export).kind == "hspec"  # the joined export loads
