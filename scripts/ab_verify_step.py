"""A w4a8 decode and verify step as decoding runs it, this tree's against another commit's, interleaved in one process.

The baseline is `--baseline`'s native decoder stack (decoder_stack.cpp and linear_product.h) calling that commit's
CPU kernels (built beside this tree's as torch.ops.hspec_baseline, scripts/ab_products.py), bound to the same
SmolLM2-135M w4a8 weights, with the greedy argmax of its time, `logits.float().argmax(-1)`; this tree's side is
the target's own stack and `sampling.greedy_tokens`. The final norm and the LM head are this tree's on both
sides (the same call). Per context S and T new tokens (T = 1: a decode), the two sides alternate forward by
forward over the same pool (each rolled back, each side first in every other round), thread CPU time,
medians; their logits and tokens are compared bit for bit every time.

    python scripts/ab_verify_step.py --baseline 87da03c [--contexts 256,2048] [--rounds 30]

Writes <out>/ab_verify_step.{json,md}. One thread (OMP_NUM_THREADS=1 is set before torch loads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from ab_products import load_beside_baseline  # noqa: E402

from hspec.cache.paged_pool import pages_for  # noqa: E402
from hspec.models.loading import load_target  # noqa: E402
from hspec.models.native import NativeDecoderStack  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402
from hspec.sampling import greedy_tokens  # noqa: E402

TOKENS = (1, 4, 8)
_STACK_FILES = ("src/hspec/models/decoder_stack.cpp", "src/hspec/models/linear_product.h")


def build_baseline_stack(commit: str, workdir: Path):
    """`commit`'s decoder stack, its operator names pointed at hspec_baseline::, built and imported."""
    from torch.utils import cpp_extension

    for path in _STACK_FILES:
        text = subprocess.run(["git", "show", f"{commit}:{path}"], check=True, capture_output=True, text=True).stdout
        (workdir / Path(path).name).write_text(text.replace('"hspec::', '"hspec_baseline::'))
    return cpp_extension.load("hspec_decoder_stack_baseline", [str(workdir / "decoder_stack.cpp")],
                              extra_cflags=["-O2"], build_directory=str(workdir), verbose=False)


def _step(model, pool, ids: torch.Tensor, context: int, stack, argmax) -> tuple[float, torch.Tensor, torch.Tensor]:
    """One forward of ids (1, T) through `stack` and its greedy tokens, rolled back: (seconds, logits, tokens)."""
    model.native = stack
    start = time.thread_time()
    logits = model.forward(ids, pool, [0]).logits
    tokens = argmax(logits)
    seconds = time.thread_time() - start
    pool.truncate(0, context)
    return seconds, logits, tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the commit whose stack and kernels are the baseline")
    p.add_argument("--contexts", default="256,2048", help="keys before the new tokens (default 256,2048)")
    p.add_argument("--rounds", type=int, default=30, help="alternating steps per side, context and T (default 30)")
    p.add_argument("--out", type=Path, default=Path("results/verify_breakdown"))
    args = p.parse_args(argv)
    target = load_target("smollm2", dtype="w4a8")
    model = target.model
    load_beside_baseline(args.baseline)
    with tempfile.TemporaryDirectory() as work:
        baseline = NativeDecoderStack(build_baseline_stack(args.baseline, Path(work)), model.config, model.layers)
    ours = model.native
    sides = {"baseline": (baseline, lambda logits: logits.float().argmax(-1)), "this tree": (ours, greedy_tokens)}
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    results, same = {}, True
    with torch.inference_mode():
        for context in (int(c) for c in args.contexts.split(",")):
            gen = torch.Generator().manual_seed(context)
            pool = model.new_pool(num_pages=pages_for(context + max(TOKENS), 16))
            pool.add_sequence(0)
            model.prefill(torch.randint(0, model.config.vocab_size, (1, context), generator=gen), pool, [0],
                          last_logits_only=True)
            times = {(name, t): [] for name in sides for t in TOKENS}
            for r in range(args.rounds + 1):  # round 0 warms up
                for t in TOKENS:
                    ids = torch.randint(0, model.config.vocab_size, (1, t), generator=gen)
                    order = list(sides) if r % 2 else list(sides)[::-1]  # each side first in every other round
                    outs = {name: _step(model, pool, ids, context, *sides[name]) for name in order}
                    same &= all(torch.equal(outs["baseline"][i], outs["this tree"][i]) for i in (1, 2))
                    if r > 0:
                        for name, (seconds, _, _) in outs.items():
                            times[(name, t)].append(1e3 * seconds)
            results[str(context)] = {name: {str(t): statistics.median(times[(name, t)]) for t in TOKENS}
                                     for name in sides}
    model.native = ours
    command = "python scripts/ab_verify_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = provenance(command.strip(), {"target": "SmolLM2-135M-Instruct", "dtype": "w4a8", "baseline": args.baseline,
                                        "contexts": args.contexts, "rounds": args.rounds, "threads": 1,
                                        "load_average_before": load_before,
                                        "load_average_after": Path("/proc/loadavg").read_text().split()[:3]})
    payload = {"provenance": meta, "same_logits_and_tokens": same, "ms": results}
    lines = ["# A w4a8 step (forward + greedy argmax): this tree against the baseline, interleaved", "",
             provenance_markdown(meta), "",
             f"Median thread CPU time (ms) of 1 forward + its greedy tokens, the sides alternating step by step; "
             f"logits and tokens equal bit for bit in every step: {'yes' if same else 'NO'}.", "",
             "| keys | side | decode (T=1) | T=4 | T=8 | T=4 / decode | T=8 / decode |",
             "|---|---|---|---|---|---|---|"]
    for context, per_side in results.items():
        for name, ms in per_side.items():
            lines.append(f"| {context} | {name} | {ms['1']:.2f} | {ms['4']:.2f} | {ms['8']:.2f} | "
                         f"{ms['4'] / ms['1']:.3f} | {ms['8'] / ms['1']:.3f} |")
    write_results(args.out, "ab_verify_step", payload, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
