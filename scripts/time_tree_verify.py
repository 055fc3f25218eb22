"""What a drafted tree's verify costs against a chain verify and a decode (docs/fast-path.md#trees).

On SmolLM2 with a prompt of S tokens in the pool, this times, interleaved round by round: a 1-token
decode, an 8-token chain verify (K = 7), and the verify of a 17-token tree (x0 and SpecBlock's node budget
of 16, three children a level) in both of the target's ways to attend over a tree: every node reading the
sequence's keys under the tree mask (`TargetModel.tree_shares_keys`, what a target with hspec's attention
kernel does) and every node reading its own gathered copy of its prefix and ancestors (`_tree_table`, what
the other targets do; forced here by patching `tree_shares_keys` off). The pool is rolled back after each
forward, so every one sees the same S keys.

    .venv/bin/python scripts/time_tree_verify.py [--dtype auto] [--contexts 128,512,1536] [--rounds 7]

Writes results/tree_verify/tree_verify.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

from hspec.cache.paged_pool import pages_for
from hspec.decoding.tree_verify import tree_attention_mask
from hspec.models.llama import TargetModel
from hspec.models.loading import load_target
from hspec.provenance import provenance, provenance_markdown, write_results

# x0, then 16 nodes: three children a level down one spine (SpecBlock's node budget, tests/test_fast_path.py)
PARENTS = (-1, 0, 0, 0, 1, 1, 1, 4, 4, 4, 7, 7, 7, 10, 10, 10, 13)


def forwards(model: TargetModel, pool, ids: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The timed forwards by name; each leaves the pool as it found it."""
    start = pool.length(0)
    mask = tree_attention_mask(torch.tensor([PARENTS]))

    def run(tokens: torch.Tensor, tree: torch.Tensor | None = None, shared: bool = True) -> None:
        with mock.patch.object(TargetModel, "tree_shares_keys", shared and model.tree_shares_keys):
            model(tokens, pool, [0], tree_mask=tree)
        pool.truncate(0, start)

    return {"decode (1 token)": lambda: run(ids[:, :1]),
            "chain verify (8 tokens)": lambda: run(ids[:, :8]),
            "tree verify (17 tokens), shared keys": lambda: run(ids, mask),
            "tree verify (17 tokens), a copy per node": lambda: run(ids, mask, shared=False)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto", help="the target's --dtype (default auto)")
    p.add_argument("--contexts", default="128,512,1536", help="prompt lengths S in the pool (default 128,512,1536)")
    p.add_argument("--rounds", type=int, default=7, help="rounds over the forwards, 2 untimed first (default 7)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--out", type=Path, default=Path("results/tree_verify"))
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.rounds < 3 or min(contexts) < 1:
        p.error(f"--rounds must be >= 3 and every context >= 1, got {args.rounds} and {args.contexts}")
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    target = load_target("smollm2", dtype=args.dtype)
    model = target.model
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    rows = []
    for s in contexts:
        pool = model.new_pool(num_pages=pages_for(s + len(PARENTS), 16))
        pool.add_sequence(0)
        model.prefill(torch.randint(0, vocab, (1, s), generator=generator), pool, [0])
        timed = forwards(model, pool, torch.randint(0, vocab, (1, len(PARENTS)), generator=generator))
        times: dict[str, list[float]] = {name: [] for name in timed}
        for round_ in range(args.rounds):
            for name, forward in timed.items():
                begin = time.perf_counter()
                forward()
                if round_ >= 2:
                    times[name].append(time.perf_counter() - begin)
        medians = {name: 1000 * statistics.median(t) for name, t in times.items()}
        rows.append({"S": s, "median_ms": medians})
        print(s, {name: round(ms, 1) for name, ms in medians.items()}, flush=True)
    meta = provenance(f"python scripts/time_tree_verify.py --dtype {args.dtype} --contexts {args.contexts} "
                      f"--rounds {args.rounds} --threads {args.threads}",
                      {"target": target.name, "dtype": model.dtype_name, "tree_shares_keys": model.tree_shares_keys,
                       "native_stack": model.native is not None, "contexts": contexts, "rounds": args.rounds,
                       "threads": args.threads, "tree_parents": list(PARENTS)})
    names = list(rows[0]["median_ms"])
    decode = names[0]
    lines = ["# A tree's verify against a chain's\n", provenance_markdown(meta),
             f"Median ms of the last {args.rounds - 2} of {args.rounds} interleaved rounds; in brackets, the "
             f"multiple of a decode.\n",
             "| S | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for row in rows:
        ms = row["median_ms"]
        lines.append(f"| {row['S']} | " + " | ".join(f"{ms[n]:.1f} ({ms[n] / ms[decode]:.2f}x)" for n in names) + " |")
    json_path, md_path = write_results(args.out, "tree_verify", {**meta, "rows": rows}, "\n".join(lines) + "\n")
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
