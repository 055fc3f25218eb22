"""H-Spec's native proposal of this tree against another commit's, interleaved in one process, same drafter.

Timings from two processes on a shared CPU say little, so this builds the other commit's drafters/hspec/native.py
and native_propose.cpp as a second extension (`hspec_native_propose_baseline`), binds both to one drafter (random
weights, Vp 8,192, as `hspec bench draft` makes it) under one target, and per round runs the target's 8-token verify
(the drafter's weights then as cold as between two decoding steps), one side's proposal, the verify again, the other
side's, alternating which goes first. A side's proposal is the whole of what `propose` runs for it, the Python
around the call included: this tree's is `drafter.propose` itself; the baseline's is what `NeuralDrafter.propose`
ran around its native call before it read the pool in place (issue 50's glue change, results/native_drafter/glue/):
the block and its context (`block_context`: the pool's K/V as stored where the side reads them so,
`reads_stored_kv`, else in the dtype torch's products take them in), the native call, the drafts' target ids and
their (1, K, V) one-hot distributions. It records each proposal's thread CPU time (one thread) and the verify's,
whether the two sides' drafts and confidences (of the timed proposals) and backbone logits (of one untimed call
each) are equal bit for bit in every round, in how many rounds the drafts are, and the largest backbone-logit
difference (two sides whose attention sums in another order differ in last bits).

    .venv/bin/python scripts/ab_native_propose.py --baseline b50caa4 [--contexts 256,2048] [--rounds 30]
        [--dtype w4a8] [--drafter-precision auto] [--out results/native_drafter/cheap_propose]

Writes <out>/ab_native_propose_<dtype>_drafter_<precision>.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from hspec.bench.draft import _create, _Setting  # noqa: E402
from hspec.bench.draft_breakdown import _load_average  # noqa: E402
from hspec.drafters.base import Proposal, one_hot_probs  # noqa: E402
from hspec.models.loading import load_target  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402
from hspec.runtime import drafter_precision_of, for_inference  # noqa: E402

NATIVE = "src/hspec/drafters/hspec/native.py"
SOURCE = "src/hspec/drafters/hspec/native_propose.cpp"


def baseline_module(commit: str, workdir: Path) -> types.ModuleType:
    """`commit`'s native.py as a module whose extension is `commit`'s native_propose.cpp under another name."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{commit}:{path}"], check=True, capture_output=True, text=True).stdout

    source = workdir / "native_propose_baseline.cpp"
    # its include of the product header, made absolute: the tree's header (the products are not compared here)
    header = Path(__file__).resolve().parents[1] / "src/hspec/models/linear_product.h"
    # its C++ class renamed (pybind11 registers a C++ type once per process; its Python name stays "Proposer")
    text = show(SOURCE).replace('"../../models/linear_product.h"', f'"{header}"')
    source.write_text("#define Proposer BaselineProposer\n" + text)
    text = show(NATIVE).replace('"hspec_native_propose"', '"hspec_native_propose_baseline"')
    text = text.replace('Path(__file__).with_name("native_propose.cpp")', repr(str(source)).join(("Path(", ")")))
    module = types.ModuleType("native_baseline")
    module.__file__ = str(workdir / "native_baseline.py")
    sys.modules[module.__name__] = module
    exec(compile(text, module.__file__, "exec"), module.__dict__)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the commit to compare against")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--dtype", default="w4a8")
    parser.add_argument("--drafter-precision", default="auto")
    parser.add_argument("--contexts", default="256,2048")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default="results/native_drafter/cheap_propose")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    target = load_target(args.target, dtype=args.dtype)
    model = target.model.eval()
    torch.manual_seed(0)
    drafter = for_inference(_create("hspec", target.config, model, 8192), target, False, args.drafter_precision)
    if drafter.native_greedy is None:
        raise SystemExit("this tree's native proposal is not bound (HSPEC_NATIVE_DRAFTER=0, or it did not build)")
    with tempfile.TemporaryDirectory() as tmp:
        old = baseline_module(args.baseline, Path(tmp))
        extension = old.build_native_propose()
        if extension is None:
            raise SystemExit(f"{args.baseline}'s native proposal did not build")
        rows = [measure(model, drafter, old.NativePropose(extension, drafter), S, args.rounds) for S in contexts]
    for row in rows:
        print(f"S={row['S']}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row["propose_cpu_ms"].items()) +
              f"; same bits in every round: {row['same_bits']}, the same drafts in "
              f"{row['rounds_with_the_same_drafts']} of {args.rounds} rounds")
    settings = {"baseline": args.baseline, "target": target.name, "dtype": model.dtype_name, "K": 7,
                "draft_vocab_size": 8192, "drafter_precision": drafter_precision_of(args.drafter_precision, target),
                "rounds": args.rounds, "contexts": contexts, "threads": torch.get_num_threads(),
                "load_average": _load_average()}
    command = (f"python scripts/ab_native_propose.py --baseline {args.baseline} --contexts {args.contexts} "
               f"--rounds {args.rounds} --dtype {args.dtype} --drafter-precision {args.drafter_precision} "
               f"--out {args.out}")
    payload = {"provenance": provenance(command, settings), "results": rows}
    name = f"ab_native_propose_{model.dtype_name}_drafter_{settings['drafter_precision']}"
    json_path, md_path = write_results(Path(args.out), name, payload, markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


def baseline_propose(drafter, native, batch, K: int) -> Proposal:
    """`NeuralDrafter.propose` for a greedy sequence its native call covers, as it ran up to the glue change."""
    if not native.covers_batch(batch, K):
        raise ValueError("the baseline's native call does not cover this batch")
    ctx = drafter.block_context(batch, K, as_stored=getattr(native, "reads_stored_kv", False))
    local, confidence = native(ctx, batch.anchor_tokens)  # (1, K) x2
    drafts = drafter.head.to_target_ids(local)
    return Proposal(drafts, one_hot_probs(drafts, drafter.config.vocab_size), confidence=confidence)


def logits_of(drafter, native, batch, K: int, baseline: bool) -> torch.Tensor:
    """The backbone logits U (1, K, Vp) of one side's proposal (an untimed call)."""
    if baseline:
        ctx = drafter.block_context(batch, K, as_stored=getattr(native, "reads_stored_kv", False))
        return native.forward(ctx, batch.anchor_tokens)[2]
    return drafter.native_drafts(native, batch, K).logits


def measure(model, drafter, baseline, S: int, rounds: int) -> dict:
    """Per round: verify, one side's proposal, verify, the other's (the first side alternating); thread CPU
    times."""
    setting = _Setting(model, {"hspec": drafter}, 1, S, 7, rounds, 0)
    batch = setting.batch
    sides = {"baseline": lambda: baseline_propose(drafter, baseline, batch, 7),
             "this tree": lambda: drafter.propose(batch, 7)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    verify: list[float] = []
    same, same_drafts, largest = True, 0, 0.0
    names = list(sides)
    with torch.inference_mode():
        for round_ in range(rounds + 1):  # round 0 warms up
            outputs = {}
            for name in names if round_ % 2 == 0 else names[::-1]:
                start = time.thread_time()
                setting.time_verify()
                verify_ms = 1e3 * (time.thread_time() - start)
                start = time.thread_time()
                proposal = sides[name]()
                elapsed = 1e3 * (time.thread_time() - start)
                outputs[name] = (proposal.draft_tokens, proposal.confidence)
                if round_:
                    times[name].append(elapsed)
                    verify.append(verify_ms)
            first, second = outputs.values()
            old_logits = logits_of(drafter, baseline, batch, 7, baseline=True)
            new_logits = logits_of(drafter, drafter.native_greedy, batch, 7, baseline=False)
            same = same and all(torch.equal(a, b) for a, b in zip(first, second, strict=True)) and torch.equal(
                old_logits, new_logits)
            same_drafts += torch.equal(first[0], second[0]) if round_ else 0
            largest = max(largest, (old_logits.float() - new_logits.float()).abs().max().item())
    setting.close()
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"S": S, "propose_cpu_ms": medians, "verify_cpu_ms": statistics.median(verify),
            "speedup": medians["baseline"] / medians["this tree"], "same_bits": same,
            "rounds_with_the_same_drafts": same_drafts, "largest_logit_difference": largest}


def markdown(payload: dict) -> str:
    lines = ["# H-Spec's native proposal: this tree against the baseline, interleaved\n",
             provenance_markdown(payload["provenance"]),
             "\nThread CPU time of one whole proposal (K = 7: this tree's `propose`; the baseline's `block_context`, "
             "native call, target ids and one-hot distributions, as its `propose` ran them), median of the rounds, the "
             "two sides alternating after a verify each; same bits: drafts, confidences and backbone logits equal "
             "in every round; same drafts: rounds whose drafts are equal; largest difference: of the backbone "
             "logits U, over the rounds.\n",
             "| S | baseline (ms) | this tree (ms) | speedup | 8-token verify (ms) | same bits | same drafts | "
             "largest difference |", "|---|---|---|---|---|---|---|---|"]
    for row in payload["results"]:
        t = row["propose_cpu_ms"]
        lines.append(f"| {row['S']} | {t['baseline']:.3f} | {t['this tree']:.3f} | {row['speedup']:.2f}x | "
                     f"{row['verify_cpu_ms']:.2f} | {'yes' if row['same_bits'] else 'no'} | "
                     f"{row['rounds_with_the_same_drafts']} of {payload['provenance']['settings']['rounds']} | "
                     f"{row['largest_logit_difference']:.3g} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
