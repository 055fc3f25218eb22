"""H-Spec's native proposal of this tree against another commit's, interleaved in one process, same drafter.

Timings from two processes on a shared CPU say little, so this builds the other commit's
drafters/hspec/native.py and native_propose.cpp as a second extension (`hspec_native_propose_baseline`), binds
both to one drafter (random weights, Vp 8,192, as `hspec bench draft` makes it) under one target, and per
round runs the target's 8-token verify (the drafter's weights then as cold as between two decoding steps),
one side's proposal, the verify again, the other side's, alternating which goes first. A side's proposal is
what `propose` runs for it: the block and its context (`block_context`: the pool's K/V as stored where the
side reads them so, `reads_stored_kv`, else in the dtype torch's products take them in), then the native call.
It records each proposal's thread CPU time (one thread) and the verify's, whether the two sides' drafts,
confidences and backbone logits are equal bit for bit in every round, in how many rounds the drafts are, and
the largest backbone-logit difference (two sides whose attention sums in another order differ in last bits).

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
        sides = {"baseline": old.NativePropose(extension, drafter), "this tree": drafter.native_greedy}
        rows = [measure(model, drafter, sides, S, args.rounds) for S in contexts]
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


def measure(model, drafter, sides: dict, S: int, rounds: int) -> dict:
    """Per round: verify, one side, verify, the other (the first side alternating); thread CPU times."""
    setting = _Setting(model, {"hspec": drafter}, 1, S, 7, rounds, 0)
    batch = setting.batch
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
                ctx = drafter.block_context(batch, 7, as_stored=getattr(sides[name], "reads_stored_kv", False))
                outputs[name] = sides[name].forward(ctx, batch.anchor_tokens)
                elapsed = 1e3 * (time.thread_time() - start)
                if round_:
                    times[name].append(elapsed)
                    verify.append(verify_ms)
            first, second = outputs.values()
            same = same and all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
            same_drafts += torch.equal(first[0], second[0]) if round_ else 0
            largest = max(largest, (first[2].float() - second[2].float()).abs().max().item())
    setting.close()
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"S": S, "propose_cpu_ms": medians, "verify_cpu_ms": statistics.median(verify),
            "speedup": medians["baseline"] / medians["this tree"], "same_bits": same,
            "rounds_with_the_same_drafts": same_drafts, "largest_logit_difference": largest}


def markdown(payload: dict) -> str:
    lines = ["# H-Spec's native proposal: this tree against the baseline, interleaved\n",
             provenance_markdown(payload["provenance"]),
             "\nThread CPU time of one proposal (`block_context`, then the native call `NativePropose.forward`, "
             "K = 7), median of the rounds, the two sides alternating after a verify each; same bits: drafts, "
             "confidences and backbone logits equal in every round; same drafts: rounds whose drafts are equal; "
             "largest difference: of the backbone logits U, over the rounds.\n",
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
