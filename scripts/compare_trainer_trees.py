"""The trainer of two source trees (e.g. main before a change and a worktree after it) timed against each
other in one run: same settings, same initial weights, same draws, interleaved rounds.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/compare_trainer_trees.py \\
        before=/work/main/src after=/work/wt/train/src --retain after --rounds 6 --round-steps 4

`hspec bench train` compares configurations of one tree; this compares trees, so a change's "before" can
be measured on the same machine at the same time as its "after". Each tree runs in its own process (its
own PYTHONPATH), holding every training sequence's features in memory; the parent tells one process at a
time to train a round (`--round-steps` steps), alternating which goes first, and reads back the round's
seconds and mean loss. Round 0 is the warm-up and is not timed. `--retain LABEL` makes that process keep
freed memory (`hspec.training.memory.retain_freed_memory`, which `hspec train` calls). Prints one line per
round and a summary (blocks/s per tree, the per-round ratio to the first tree, the last losses: the same
draws from the same weights, so they should agree to the precision's rounding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import json, sys, time, torch
    from pathlib import Path
    torch.set_num_threads(1)
    if RETAIN:
        from hspec.training.memory import retain_freed_memory
        retain_freed_memory()
    from hspec.drafters import create_drafter, drafter_config
    from hspec.models.loading import load_target
    from hspec.training.run import _draft_vocabulary, is_validation
    from hspec.training.store import FeatureStores
    from hspec.training.trainer import TrainConfig, Trainer
    target = load_target(TARGET)
    store = FeatureStores([Path(p) for p in FEATURES])
    train_ids = [i for i in store.available() if not is_validation(store.ids[i])]
    vocab = _draft_vocabulary(store, train_ids, target.config.vocab_size, VOCAB)
    feats = {i: store.load(i).with_teacher(target.model) for i in train_ids}
    torch.manual_seed(0)
    drafter = create_drafter(KIND, target.config, target_model=target.model,
                             config=drafter_config(KIND, target.config, draft_vocab_size=VOCAB))
    drafter.head.set_vocab(vocab)
    config = TrainConfig(steps=STEPS, seqs_per_step=SEQS, anchors_per_seq=ANCHORS, precision=PRECISION)
    trainer = Trainer(drafter, target.model, feats.__getitem__, train_ids, config)
    print("ready", flush=True)
    for line in sys.stdin:
        first, last = map(int, line.split())
        start = time.perf_counter()
        losses = [trainer.train_step(step).loss for step in range(first, last)]
        print(json.dumps({"seconds": time.perf_counter() - start, "loss": sum(losses) / len(losses)}), flush=True)
""")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", help="LABEL=SRC_DIR, each a tree's src/ directory")
    p.add_argument("--retain", default="", help="comma-separated labels whose process keeps freed memory")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--features", default="runs/features/part1", help="feature cache dir(s), comma-separated")
    p.add_argument("--kind", default="hspec")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--anchors-per-seq", type=int, default=16)
    p.add_argument("--precision", default="bf16-autocast")
    p.add_argument("--rounds", type=int, default=6, help="rounds, the first untimed (default 6)")
    p.add_argument("--round-steps", type=int, default=4, help="steps per tree per round (default 4)")
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees)
    retain = set(filter(None, args.retain.split(",")))
    steps = args.rounds * args.round_steps
    settings = {"TARGET": args.target, "FEATURES": args.features.split(","), "KIND": args.kind,
                "VOCAB": args.draft_vocab, "STEPS": steps, "SEQS": args.seqs_per_step,
                "ANCHORS": args.anchors_per_seq, "PRECISION": args.precision}
    children = {}
    for label, src in trees.items():
        code = "".join(f"{k} = {v!r}\n" for k, v in {**settings, "RETAIN": label in retain}.items()) + CHILD
        env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
        children[label] = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, env=env)
    for label, child in children.items():  # one at a time would be fairer but slower; loading is untimed
        if child.stdout is None or child.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{label}: the training process did not start")
    labels, blocks = list(children), args.round_steps * args.seqs_per_step * args.anchors_per_seq
    rows = []
    for r in range(args.rounds):
        order = labels if r % 2 == 0 else labels[::-1]
        row = {}
        for label in order:
            child = children[label]
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write(f"{r * args.round_steps} {(r + 1) * args.round_steps}\n")
            child.stdin.flush()
            row[label] = json.loads(child.stdout.readline())
        rows.append(row)
        print(f"round {r}{' (warm-up)' if r == 0 else ''}: " + ", ".join(
            f"{label} {blocks / row[label]['seconds']:.1f} blocks/s loss {row[label]['loss']:.4f}" for label in labels),
            flush=True)
    for child in children.values():
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    timed = rows[1:]
    for label in labels:
        seconds = sum(row[label]["seconds"] for row in timed)
        ratios = [row[labels[0]]["seconds"] / row[label]["seconds"] for row in timed]
        ms_per_step = 1000 * seconds / (len(timed) * args.round_steps)
        print(f"{label}: {blocks * len(timed) / seconds:.1f} blocks/s, {ms_per_step:.0f} ms/step, "
              f"x{statistics.median(ratios):.2f} {labels[0]} (min {min(ratios):.2f}, max {max(ratios):.2f}), "
              f"last-round loss {rows[-1][label]['loss']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
