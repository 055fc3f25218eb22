"""Training in fp32 vs bf16 autocast on this machine: steps/s (interleaved rounds) and validation tau at the
same step count, for the shipped kind (hspec, draft vocabulary 8192) on real target features.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_train_precision.py

Features come from the committed corpus (`hspec data features` on results/train_data/corpus_part1.jsonl,
cached under runs/features/precision_part1 on the first run). Writes results/train_precision_<device>.{json,md}
with provenance. The method is in hspec/training/precision_bench.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hspec.models.dtype import cpu_has_native_bf16
from hspec.models.loading import load_target
from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.training.precision import resolve_precision
from hspec.training.precision_bench import compare_precisions
from hspec.training.run import _draft_vocabulary, build_features, held_out_ids, is_validation
from hspec.training.store import FeatureStores
from hspec.training.trainer import TrainConfig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--corpus", default="results/train_data/corpus_part1.jsonl",
                   help="generated corpus the features are built from when --features does not exist yet")
    p.add_argument("--features", default="runs/features/precision_part1", help="feature cache dir")
    p.add_argument("--kind", default="hspec", help="drafter kind (default hspec, the shipped one)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="pruned draft vocabulary Vp (default 8192, shipped)")
    # Short by default: on an AVX2-only CPU a bf16-autocast step takes about a minute (bf16 matrix products
    # are emulated); on a CPU with native bf16 or a GPU, raise --steps for a sharper tau comparison.
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per precision (default 12)")
    p.add_argument("--round-steps", type=int, default=3, help="steps per interleaved round (default 3)")
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--anchors-per-seq", type=int, default=16)
    p.add_argument("--val-sequences", type=int, default=24, help="held-out sequences validated on (default 24)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the CPU is shared)")
    p.add_argument("--out", default="results", help="output directory")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    features = Path(args.features)
    if not (features / "index.json").exists():
        build_features(args.target, Path(args.corpus), features)
    target = load_target(args.target)
    store = FeatureStores([features])
    train_ids = [i for i in store.available() if not is_validation(store.ids[i])]
    val_ids = held_out_ids(store, args.val_sequences)
    vocab = _draft_vocabulary(store, train_ids, target.config.vocab_size, args.draft_vocab)
    config = TrainConfig(steps=args.steps, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq)
    result = compare_precisions(target, args.kind, store.load, train_ids, val_ids, vocab, config, args.round_steps)

    command = "python scripts/bench_train_precision.py " + " ".join(sys.argv[1:])
    settings = {"target": target.name, "kind": args.kind, "draft_vocab_size": args.draft_vocab,
                "features": str(features), "corpus": args.corpus, "train_sequences": len(train_ids),
                "val_sequences": len(val_ids), "steps": args.steps, "round_steps": args.round_steps,
                "seqs_per_step": args.seqs_per_step, "anchors_per_seq": args.anchors_per_seq,
                "threads": args.threads, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                "cpu_native_bf16": cpu_has_native_bf16(), "auto_precision": resolve_precision("auto", "cpu")}
    payload = {"provenance": provenance(command.strip(), settings), **result}
    json_path, md_path = write_results(Path(args.out), "train_precision_cpu", payload, markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


def markdown(payload: dict) -> str:
    s, summary, ratio = payload["provenance"]["settings"], payload["summary"], payload["ratio"]
    lines = ["# Drafter training: fp32 vs bf16 autocast on this CPU\n", provenance_markdown(payload["provenance"]),
             f"\n{s['kind']} (Vp {s['draft_vocab_size']}), {s['steps']} steps per precision from the same initial "
             f"weights on the same draws ({s['seqs_per_step']} sequences x {s['anchors_per_seq']} anchors a step, "
             f"{s['train_sequences']} training sequences), interleaved in rounds of {s['round_steps']} steps "
             f"(A B, B A, ...). Validation on {s['val_sequences']} held-out sequences, in fp32 for both. This CPU: "
             f"torch capability {s['cpu_capability']}, native bf16 dot products: {s['cpu_native_bf16']}; "
             f"`--precision auto` picks {s['auto_precision']} here.\n",
             "| precision | steps/s | final-round loss | validation tau | tau in decode order |",
             "|---|---|---|---|---|"]
    for precision, row in summary.items():
        lines.append(f"| {precision} | {row['steps_per_s']:.3f} | {row['final_round_loss']:.4f} | "
                     f"{row['validation']['mean_accepted_length']:.3f} | "
                     f"{row['validation_decode_order']['mean_accepted_length']:.3f} |")
    lines += ["", f"bf16-autocast / fp32 steps/s per round: median {ratio['median']:.2f}x "
                  f"(min {ratio['min']:.2f}, max {ratio['max']:.2f}, {len(payload['rounds'])} rounds).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
