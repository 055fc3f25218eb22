"""How long would the long comparison's training take on one GPU? (results/gpu_training_probe/README.md)

The long comparison (scripts/compare_long.sh) trains 14 drafter kinds for 3,000 steps each with one small
recipe: 4 sequences x 16 anchors a step, bf16 autocast, features computed by the target. This times that
step on a CUDA GPU for every kind, three ways:

- alone: one process trains one kind at a time (features computed online, as `hspec train --corpus` does);
- cached: the same, with the sequences' target features computed once beforehand and kept on the GPU
  (the step then holds only the drafter's forward, backward and update);
- side by side: one process per kind, all at once, sharing the GPU; and again under CUDA MPS where the
  machine has `nvidia-cuda-mps-control` (kernels of several processes then run concurrently).

Step times do not depend on the weights' values, so the target is SmolLM2-135M-Instruct's shape with random
weights (its config is read from the shipped drafter; the GGUF need not travel) and the sequences are
committed training data (results/train_data/corpus_part1.jsonl). From each way's median step time it
projects the minutes that 3,000 steps of every kind take.

    python scripts/probe_gpu_training.py --out results/gpu_training_probe

Writes OUT/gpu_training_probe.{json,md}. `--device cpu --steps 3 --kinds hspec,dflash` makes a dry run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hspec.drafters import create_drafter, drafter_config
from hspec.drafters.common import kv_layer_of, select_target_layers
from hspec.models.config import RopeScaling, TargetConfig
from hspec.models.llama import TargetModel
from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.training.features import OnlineFeatures
from hspec.training.run import is_validation
from hspec.training.trainer import TrainConfig, Trainer
from hspec.training.vocab import most_frequent_tokens

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DRAFTER_CONFIG = ROOT / "src/hspec/assets/hspec-smollm2-135m-instruct/config.json"
KINDS = ("hspec", "dflash", "peagle", "dspark", "dflash-kvreuse", "hspec-lasttoken-only", "hspec-kvreuse-only",
         "mamba-only", "attention-only", "hspec-nomarkov", "dflash2", "dfly", "dels", "specblock")
RECIPE_STEPS = 3000  # scripts/compare_long.sh
DRAFT_VOCAB = 8192
WARMUP_STEPS = 5
CACHED_SEQUENCES = 32


def smollm2_shape() -> TargetConfig:
    """SmolLM2-135M-Instruct's config, as the shipped drafter records it."""
    raw = dict(json.loads(SHIPPED_DRAFTER_CONFIG.read_text())["hspec_drafter_config"]["target"])
    return TargetConfig(**{**raw, "rope_scaling": RopeScaling(**raw["rope_scaling"]),
                           "eos_token_ids": tuple(raw["eos_token_ids"])})


def time_kinds(kinds: list[str], steps: int, cached: bool, corpus: Path, device: torch.device) -> dict[str, dict]:
    """Median and mean seconds of `steps` recipe steps (after `WARMUP_STEPS`) of each kind, one after another."""
    config = smollm2_shape()
    torch.manual_seed(0)
    target = TargetModel(config).to(device).eval()
    layers = select_target_layers(config.num_layers)
    store = OnlineFeatures([corpus], target, "SmolLM2-135M-Instruct (random weights)", layers,
                           [kv_layer_of(layer) for layer in layers])
    train_ids = [i for i in store.available() if not is_validation(store.ids[i])]
    counts = torch.zeros(config.vocab_size, dtype=torch.long)
    for i in train_ids:
        counts += torch.bincount(store.tokens(i), minlength=config.vocab_size)
    vocab = most_frequent_tokens((store.tokens(i).tolist() for i in train_ids), config.vocab_size, DRAFT_VOCAB)
    load = store.load
    if cached:
        train_ids = train_ids[:CACHED_SEQUENCES]
        features = {i: store.load(i).to(device) for i in train_ids}
        load = features.__getitem__
    recipe = TrainConfig(steps=RECIPE_STEPS, seqs_per_step=4, anchors_per_seq=16,
                         precision="bf16-autocast" if device.type == "cuda" else "fp32")
    out = {}
    for kind in kinds:
        try:
            seconds = _step_seconds(kind, config, target, load, train_ids, vocab, counts, recipe, steps, device)
        except Exception as error:  # one kind failing on this device must not lose the others' times
            out[kind] = {"error": f"{type(error).__name__}: {error}"}
            print(f"[probe] {kind}: {out[kind]['error']}", file=sys.stderr, flush=True)
            continue
        out[kind] = {"median_s": statistics.median(seconds), "mean_s": statistics.fmean(seconds), "steps": steps,
                     "precision": recipe.precision}
        print(f"[probe] {kind} {'cached' if cached else 'online'}: {1000 * out[kind]['median_s']:.0f} ms a step",
              file=sys.stderr, flush=True)
    return out


def _step_seconds(kind: str, config: TargetConfig, target: TargetModel, load, train_ids: list[int],
                  vocab: torch.Tensor, counts: torch.Tensor, recipe: TrainConfig, steps: int,
                  device: torch.device) -> list[float]:
    """Seconds of each of `steps` recipe steps of a fresh `kind` drafter, after `WARMUP_STEPS`."""
    drafter = create_drafter(kind, config, target_model=target,
                             config=drafter_config(kind, config, draft_vocab_size=DRAFT_VOCAB))
    drafter.head.set_vocab(vocab)
    drafter.to(device)
    if hasattr(drafter, "set_log_prior"):
        drafter.set_log_prior(counts)
    trainer = Trainer(drafter, target, load, train_ids, recipe)
    return [trainer.train_step(step).seconds for step in range(WARMUP_STEPS + steps)][WARMUP_STEPS:]


def side_by_side(kinds: list[str], steps: int, args: argparse.Namespace, env: dict[str, str]) -> dict:
    """Every kind in a process of its own, all started at once; each process's step times and the wall time."""
    start = time.perf_counter()
    procs = {kind: subprocess.Popen([sys.executable, __file__, "--child", "--kinds", kind, "--steps", str(steps),
                                     "--corpus", str(args.corpus), "--device", args.device],
                                    stdout=subprocess.PIPE, env=env, text=True) for kind in kinds}
    per_kind = {}
    for kind, proc in procs.items():
        try:
            stdout, _ = proc.communicate(timeout=args.child_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            per_kind[kind] = {"error": f"no answer within {args.child_timeout:.0f} s"}
            continue
        lines = stdout.strip().splitlines()
        per_kind.update(json.loads(lines[-1]) if proc.returncode == 0 and lines
                        else {kind: {"error": f"exit code {proc.returncode}"}})
    return {"per_kind": per_kind, "wall_s": time.perf_counter() - start}


@contextlib.contextmanager
def mps_daemon(env: dict[str, str]):
    """CUDA MPS for the processes started with the returned environment; yields None where it cannot start."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="mps-"))
    mps_env = {**env, "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    (folder / "pipe").mkdir()
    (folder / "log").mkdir()
    started = subprocess.run([control, "-d"], env=mps_env, capture_output=True, text=True)
    if started.returncode != 0:
        print(f"[probe] MPS did not start: {started.stderr.strip()}", file=sys.stderr, flush=True)
        yield None
        return
    try:
        yield mps_env
    finally:
        subprocess.run([control], input="quit\n", env=mps_env, capture_output=True, text=True)


def projections(alone: dict[str, dict], together: dict | None) -> dict[str, float]:
    """Minutes of 3,000 steps of every kind: one kind after another, or all side by side (the slowest kind)."""
    timed = [r["median_s"] for r in alone.values() if "median_s" in r]
    out = {"one after another": sum(timed) * RECIPE_STEPS / 60}
    if together is not None:
        timed = [r["median_s"] for r in together["per_kind"].values() if "median_s" in r]
        out["side by side"] = max(timed, default=float("nan")) * RECIPE_STEPS / 60
    return out


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    return f"{1000 * row['median_s']:.0f}" if "median_s" in row else f"failed ({row['error']})"


def markdown(meta: dict, result: dict) -> str:
    ways = [(key, label) for key, label in (("online", "alone, online features"), ("cached", "alone, cached features"),
                                            ("side_by_side", "side by side"), ("mps", "side by side under MPS"))
            if key in result]
    precision = meta["settings"]["precision"]
    lines = ["# The long comparison's training step on one GPU\n", provenance_markdown(meta),
             f"Median milliseconds of one recipe step (4 sequences x 16 anchors, {precision}; SmolLM2-135M's shape "
             f"with random weights), after {WARMUP_STEPS} warm-up steps. Side by side: one process per kind, all "
             f"started at once.\n",
             "| kind | " + " | ".join(label for _, label in ways) + " |", "|---|" + "---|" * len(ways)]
    for kind in meta["settings"]["kinds"]:
        rows = [result[key].get("per_kind", result[key]).get(kind) for key, _ in ways]
        lines.append(f"| {kind} | " + " | ".join(_cell(row) for row in rows) + " |")
    if "projections" in result:
        lines += ["", f"Projected minutes for {RECIPE_STEPS:,} steps of every kind timed:", ""]
        lines += [f"- {way}: {minutes:.0f}" for way, minutes in result["projections"].items()]
    if result.get("mps_unavailable"):
        lines.append(f"\nMPS: {result['mps_unavailable']}")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated drafter kinds (default: all 14)")
    p.add_argument("--steps", type=int, default=15, help="timed steps per kind and way (default 15)")
    p.add_argument("--corpus", type=Path, default=ROOT / "results/train_data/corpus_part1.jsonl")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run)")
    p.add_argument("--child-timeout", type=float, default=100, help="seconds a side-by-side process may take")
    p.add_argument("--out", type=Path, default=ROOT / "results/gpu_training_probe")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        p.error(f"unknown kinds {unknown}; allowed: {', '.join(KINDS)}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    device = torch.device(args.device)
    if args.child:
        print(json.dumps(time_kinds(kinds, args.steps, False, args.corpus, device)), flush=True)
        return 0
    corpus = str(args.corpus.relative_to(ROOT)) if args.corpus.is_relative_to(ROOT) else str(args.corpus)
    meta = provenance(" ".join(["python", "scripts/probe_gpu_training.py", *sys.argv[1:]]),
                      {"kinds": kinds, "steps": args.steps, "device": args.device,
                       "precision": "bf16-autocast" if device.type == "cuda" else "fp32", "seqs_per_step": 4,
                       "anchors_per_seq": 16, "draft_vocab": DRAFT_VOCAB, "cached_sequences": CACHED_SEQUENCES,
                       "corpus": corpus})
    result: dict = {}

    def save() -> None:  # after every way, so a run cut short still leaves what it timed
        write_results(args.out, "gpu_training_probe", {**meta, **result}, markdown(meta, result))

    result["online"] = time_kinds(kinds, args.steps, False, args.corpus, device)
    save()
    result["cached"] = time_kinds(kinds, args.steps, True, args.corpus, device)
    save()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result["side_by_side"] = side_by_side(kinds, args.steps, args, env)
    save()
    with mps_daemon(env) as mps_env:
        if mps_env is None:
            result["mps_unavailable"] = "no nvidia-cuda-mps-control, or it did not start"
        else:
            result["mps"] = side_by_side(kinds, args.steps, args, mps_env)
    result["projections"] = projections(result["online"], result["side_by_side"])
    if result.get("mps"):
        result["projections"]["side by side under MPS"] = projections(result["online"], result["mps"])["side by side"]
    save()
    print(f"wrote {args.out / 'gpu_training_probe'}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
