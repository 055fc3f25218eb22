"""Where a training step's time goes on this machine: the trainer's step under torch.profiler, by operator.

`hspec bench train` measures blocks per second; this says what a step spends them on, so a change to the trainer
can be aimed (and its ceiling computed: what is left if an operator class went away). One H-Spec drafter from
fresh weights, the recipe's step (`Trainer.train_step`: forward, loss, backward, clipping, AdamW) on the feature
cache given, WARMUP untimed steps, then STEPS steps timed without the profiler and PROFILED steps under it.
Writes <out>/<name>.{json,md}: the step's milliseconds and blocks per second, the operators by self CPU time
(share of the profiled time, calls, milliseconds a step), and the share of the matrix products (`aten::mm`,
`aten::bmm`, `aten::addmm`, `aten::baddbmm`, the bf16/AMX ones included) with the GFLOP/s they reached where a
block's multiply-adds are known (the step's FLOP count from the profiler's own `with_flops`).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/profile_train_step.py [--features runs/features/part1]
        [--seqs-per-step 4] [--anchors-per-seq 16] [--precision fp32] [--steps 8] [--profiled 4]
        [--out results/train_throughput] [--name profile_step_<precision>]
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch.profiler import profile  # noqa: E402

from hspec.drafters import create_drafter, drafter_config  # noqa: E402
from hspec.models.loading import load_target  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402
from hspec.training.memory import retain_freed_memory  # noqa: E402
from hspec.training.run import _draft_vocabulary, is_validation  # noqa: E402
from hspec.training.store import FeatureStores  # noqa: E402
from hspec.training.trainer import TrainConfig, Trainer  # noqa: E402

PRODUCTS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_weight_int8pack_mm", "aten::linear")
WARMUP = 4
SHOWN = 25  # operators in the table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=Path, default=Path("runs/features/part1"),
                        help="a feature cache (`hspec data features`)")
    parser.add_argument("--seqs-per-step", type=int, default=4)
    parser.add_argument("--anchors-per-seq", type=int, default=16)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16-autocast"))
    parser.add_argument("--steps", type=int, default=8, help="steps timed without the profiler")
    parser.add_argument("--profiled", type=int, default=4, help="steps timed under the profiler")
    parser.add_argument("--out", type=Path, default=Path("results/train_throughput"))
    parser.add_argument("--name", default=None, help="stem of the result files (default profile_step_<precision>)")
    args = parser.parse_args()
    if not (args.features / "index.json").exists():
        parser.error(f"no feature cache at {args.features}; make one with `hspec data features`")
    if args.steps < 1 or args.profiled < 1:
        parser.error(f"--steps and --profiled must be >= 1, got {args.steps} and {args.profiled}")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    retain_freed_memory()  # as `hspec train` does
    target = load_target("smollm2")
    store = FeatureStores([args.features])
    train_ids = [i for i in store.available() if not is_validation(store.ids[i])]
    vocab = _draft_vocabulary(store, train_ids, target.config.vocab_size, 8192)

    @functools.cache
    def load(i: int):  # each sequence read once, as `hspec bench train` keeps them
        return store.load(i).with_teacher(target.model)

    torch.manual_seed(0)
    drafter = create_drafter("hspec", target.config, target_model=target.model,
                             config=drafter_config("hspec", target.config, draft_vocab_size=vocab.numel()))
    drafter.head.set_vocab(vocab)
    steps = WARMUP + args.steps + args.profiled
    trainer = Trainer(drafter, target.model, load, train_ids,
                      TrainConfig(steps=steps, seqs_per_step=args.seqs_per_step,
                                  anchors_per_seq=args.anchors_per_seq, precision=args.precision))
    for step in range(WARMUP):
        trainer.train_step(step)
    start = time.perf_counter()
    for step in range(WARMUP, WARMUP + args.steps):
        trainer.train_step(step)
    seconds = (time.perf_counter() - start) / args.steps
    with profile(with_flops=True) as prof:
        for step in range(WARMUP + args.steps, steps):
            trainer.train_step(step)
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    ops = sorted(({"name": e.key, "calls": e.count // args.profiled,
                   "ms_per_step": e.self_cpu_time_total / 1e3 / args.profiled,
                   "share": e.self_cpu_time_total / total_us, "flops_per_step": e.flops / args.profiled}
                  for e in events), key=lambda o: -o["ms_per_step"])
    products = [o for o in ops if o["name"] in PRODUCTS]
    product_ms = sum(o["ms_per_step"] for o in products)
    product_flops = sum(o["flops_per_step"] for o in products)
    blocks = args.seqs_per_step * args.anchors_per_seq
    summary = {"ms_per_step": 1e3 * seconds, "blocks_per_s": blocks / seconds,
               "profiled_ms_per_step": total_us / 1e3 / args.profiled, "products_share": product_ms * 1e3
               / (total_us / args.profiled), "products_gflop_per_s": product_flops / (product_ms / 1e3) / 1e9
               if product_ms else None}
    settings = {"features": str(args.features), "seqs_per_step": args.seqs_per_step,
                "anchors_per_seq": args.anchors_per_seq, "precision": args.precision, "warmup": WARMUP,
                "steps": args.steps, "profiled": args.profiled, "threads": torch.get_num_threads(),
                "load_average": [round(x, 2) for x in os.getloadavg()]}
    command = (f"python scripts/profile_train_step.py --features {args.features} --seqs-per-step "
               f"{args.seqs_per_step} --anchors-per-seq {args.anchors_per_seq} --precision {args.precision} "
               f"--steps {args.steps} --profiled {args.profiled}")
    payload = {"provenance": provenance(command, settings), "summary": summary, "operators": ops[:SHOWN * 2]}
    name = args.name or f"profile_step_{args.precision}"
    json_path, md_path = write_results(args.out, name, payload, markdown(payload))
    print(f"{summary['ms_per_step']:.0f} ms a step, {summary['blocks_per_s']:.1f} blocks/s; "
          f"products {summary['products_share']:.0%}; wrote {json_path} and {md_path}")
    return 0


def markdown(payload: dict) -> str:
    s = payload["summary"]
    settings = payload["provenance"]["settings"]
    rate = "" if s["products_gflop_per_s"] is None else f", at {s['products_gflop_per_s']:.1f} GFLOP/s"
    lines = ["# Where a training step's time goes\n", provenance_markdown(payload["provenance"]),
             f"\nH-Spec from fresh weights, {settings['seqs_per_step']} x {settings['anchors_per_seq']} blocks a step, "
             f"{settings['precision']}: **{s['ms_per_step']:.0f} ms a step, {s['blocks_per_s']:.1f} blocks/s** "
             f"(the mean of {settings['steps']} steps without the profiler). Under the profiler "
             f"{s['profiled_ms_per_step']:.0f} ms a step, of which the matrix products "
             f"{s['products_share']:.0%}{rate}.\n",
             "| operator | share | calls a step | ms a step |", "|---|---|---|---|"]
    for o in payload["operators"][:SHOWN]:
        lines.append(f"| `{o['name']}` | {o['share']:.1%} | {o['calls']} | {o['ms_per_step']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
