"""Speculative speedups under two commits of hspec, item by item on the same machine: does a change to the code
around the target's forward (Python, torch operators) move what `hspec eval` measures?

Two worker processes, one importing this tree's `hspec` and one a baseline commit's (a git worktree of it,
its native kernels built in their own extensions directory), each with the w4a8 target and the given drafter
strings. The driver hands each Spec-Bench item to one worker and then to the other (which one goes first
alternates), and each worker decodes the item with plain decoding and every method (their order reversed every
other item), greedy, K <= 7, 128 new tokens, checking every output equal to its plain decoding's. So both
trees' runs of an item sit next to each other in time, and a drifting VM weighs on both alike; each tree's
speedups are over its own plain decoding of the same items (decode phase), as `hspec eval` reports them. Both
read the same cached step costs when their kernels are the same (`decoding/step_cost.py`), so `:auto` drafts
the same lengths under both.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/ab_commits.py --baseline df4d1f2 [--size 8]
        [--methods ngram:auto,hspec:auto,hspec+ngram:auto] [--out results/adaptive_length/ab_commits]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")
K = 7
MAX_NEW_TOKENS = 128
ROOT = Path(__file__).resolve().parents[1]


def worker(methods: list[str]) -> int:
    """Read "task index" lines; for each, decode that item with plain decoding and every method and write one
    JSON line of their decode seconds and token counts."""
    import torch

    from hspec.data.tasks import load_task
    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.models.loading import load_target
    from hspec.runtime import build_drafter
    from hspec.sampling import SamplingParams

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    target = load_target(None, dtype="w4a8")
    kinds = ["none", *methods]
    decoders = {kind: SpeculativeDecoder(target.model, build_drafter(kind, target, K=K), K,
                                         target.tokenizer.eos_token_ids) for kind in kinds}
    greedy = SamplingParams()
    warm = target.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    for decoder in decoders.values():
        decoder.generate([warm], greedy, 16)
    tasks: dict[str, list] = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        task, index, size = line.split()
        items = tasks.setdefault(task, load_task(task, int(size)).items)
        item = items[int(index)]
        prompt = target.tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}])
        order = kinds if int(index) % 2 == 0 else kinds[::-1]
        outputs = {kind: decoders[kind].generate([prompt], greedy, MAX_NEW_TOKENS) for kind in order}
        plain = outputs["none"].sequences[0].token_ids
        if any(out.sequences[0].token_ids != plain for out in outputs.values()):
            raise SystemExit(f"{item.id}: an output differs from plain decoding's")
        print(json.dumps({"item": item.id, "tokens": plain,
                          "runs": {kind: [out.decode_s, out.num_new_tokens - 1] for kind, out in outputs.items()}}),
              flush=True)
    return 0


def baseline_tree(commit: str) -> Path:
    """A worktree of `commit` (made once, kept under the system's temporary directory)."""
    full = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"hspec_ab_{full[:12]}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), full], cwd=ROOT, check=True)
    return path


def start(src: Path, extensions: Path | None, methods: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(src)}
    if extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    process = subprocess.Popen([sys.executable, __file__, "--worker", "--methods", ",".join(methods)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    if json.loads(process.stdout.readline()) != {"ready": True}:  # type: ignore[union-attr]
        raise SystemExit(f"the worker on {src} did not start")
    return process


def ask(process: subprocess.Popen, task: str, index: int, size: int) -> dict:
    process.stdin.write(f"{task} {index} {size}\n")  # type: ignore[union-attr]
    process.stdin.flush()  # type: ignore[union-attr]
    line = process.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise SystemExit(f"a worker stopped on {task} item {index}")
    return json.loads(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="the commit compared with this tree")
    parser.add_argument("--size", type=int, default=8, help="Spec-Bench items a task")
    parser.add_argument("--methods", default="ngram:auto,hspec:auto,hspec+ngram:auto")
    parser.add_argument("--out", type=Path, default=Path("results/adaptive_length/ab_commits"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    methods = args.methods.split(",")
    if args.worker:
        return worker(methods)
    if args.baseline is None:
        parser.error("--baseline COMMIT is needed")
    from hspec.bench.draft_breakdown import _load_average
    from hspec.provenance import provenance, write_results

    old_tree = baseline_tree(args.baseline)
    workers = {"baseline": start(old_tree / "src", old_tree / ".torch_extensions", methods),
               "this tree": start(ROOT / "src", None, methods)}
    sums = {name: {task: {kind: [0.0, 0] for kind in ["none", *methods]} for task in TASKS} for name in workers}
    for task in TASKS:
        for index in range(args.size):
            names = list(workers) if index % 2 == 0 else list(workers)[::-1]
            answers = {name: ask(workers[name], task, index, args.size) for name in names}
            if answers["baseline"]["tokens"] != answers["this tree"]["tokens"]:
                raise SystemExit(f"{answers['baseline']['item']}: the two trees' plain outputs differ")
            for name, answer in answers.items():
                for kind, (seconds, tokens) in answer["runs"].items():
                    sums[name][task][kind][0] += seconds
                    sums[name][task][kind][1] += tokens
            print(task, index, flush=True)
    for process in workers.values():
        process.stdin.close()  # type: ignore[union-attr]
        process.wait()
    rows = []
    for task in (*TASKS, "all"):
        row = {"task": task}
        for name in workers:
            per_kind = {kind: [sum(sums[name][t][kind][i] for t in TASKS if task in ("all", t)) for i in (0, 1)]
                        for kind in ["none", *methods]}
            rate = {kind: tokens / seconds for kind, (seconds, tokens) in per_kind.items()}
            row[name] = {"plain_tok_s": rate["none"], **{kind: rate[kind] / rate["none"] for kind in methods}}
        rows.append(row)
    settings = {"baseline": args.baseline, "dtype": "w4a8", "K": K, "max_new_tokens": MAX_NEW_TOKENS,
                "size_per_task": args.size, "methods": methods, "threads": int(os.environ.get("OMP_NUM_THREADS", 2)),
                "load_average": _load_average()}
    command = f"python scripts/ab_commits.py --baseline {args.baseline} --size {args.size} --methods {args.methods}"
    payload = {"provenance": provenance(command, settings), "results": rows}
    json_path, md_path = write_results(args.out, "ab_commits", payload, markdown(payload, methods))
    print(f"wrote {json_path} and {md_path}")
    return 0


def markdown(payload: dict, methods: list[str]) -> str:
    from hspec.provenance import provenance_markdown

    baseline = payload["provenance"]["settings"]["baseline"]
    lines = ["# Speculative speedups under two commits, item by item\n", provenance_markdown(payload["provenance"]),
             f"\nDecode-phase speed over each tree's own plain decoding of the same items (greedy, K <= 7, w4a8, "
             f"every output equal to plain's); the baseline is {baseline}, the other this commit (module docstring "
             "of `scripts/ab_commits.py`).\n",
             "| task | plain tok/s (baseline / this) | " + " | ".join(f"{m} (baseline / this)" for m in methods) + " |",
             "|---|---|" + "---|" * len(methods)]
    for row in payload["results"]:
        old, new = row["baseline"], row["this tree"]
        lines.append(f"| {row['task']} | {old['plain_tok_s']:.1f} / {new['plain_tok_s']:.1f} | "
                     + " | ".join(f"{old[m]:.3f}x / {new[m]:.3f}x" for m in methods) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
