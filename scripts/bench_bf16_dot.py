"""Whether vdpbf16ps (AVX512-BF16) or AMX can halve the arithmetic of a long verify's attention (issue 50, item 5).

    .venv/bin/python scripts/bench_bf16_dot.py --out results/attention_scaling/bf16_dot

Builds scripts/bf16_dot_probe.c with gcc and runs it on this CPU: 1. the instruction's semantics, brute force
against a scalar model and against its AVX2 replay (two FMAs under MXCSR DAZ|FTZ), denormals included; 2. its
rate against the fp32 FMA's (independent accumulators, thread CPU time, interleaved rounds); 3. a verify's
scores for one (layer, KV head) in the kernel's tile shape, FMA form against dot form; 4. AMX's tdpbf16ps, the
same semantics check and its rate. Then the arithmetic against the goal: the extra multiply-adds of an 8-token
verify at 2,048 keys over one at 256 (w4a8 SmolLM2-135M: 30 layers x 3 KV heads, 24 query rows a head, D = 64,
scores and value sums), at each measured rate, beside the time 1.3x allows (of the verify at 256 keys in 5.).
5. hspec's attention kernel itself
(`torch.ops.hspec.attention`, over bf16 K/V laid out as the target's pool lays them out, K transposed) for a
decode and an 8-token verify (causal mask) at 256 and 2,048 keys, 30 layers' own K/V in turn (from memory,
as a forward reads them), beside the target's whole verify forward, interleaved, thread CPU time: what the 30
layers' calls add at 2,048 keys beside what their multiply-adds take at the FMA's rate. Writes
<out>/bf16_dot.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from ab_attention import DIM, HKV, HQ, LAYERS, TOKENS, causal_queries, pool_layers  # noqa: E402

from hspec.cache.paged_pool import pages_for  # noqa: E402
from hspec.models.loading import load_target  # noqa: E402
from hspec.models.native import load_kernels  # noqa: E402
from hspec.provenance import provenance, provenance_markdown, write_results  # noqa: E402

PROBE = Path(__file__).with_name("bf16_dot_probe.c")
# w4a8 SmolLM2-135M's attention in an 8-token verify: (layer, KV head) pairs and query rows a pair (8 tokens x 3
# query heads).
PAIRS, ROWS = 30 * 3, 8 * 3
GOAL = 1.3


def run_probe(vectors: int, rounds: int) -> dict[str, float]:
    """The probe's "name value" lines as a dict (the probe built in a temporary directory)."""
    with tempfile.TemporaryDirectory() as workdir:
        binary = Path(workdir) / "bf16_dot_probe"
        subprocess.run(["gcc", "-O2", str(PROBE), "-o", str(binary), "-lm"], check=True)
        text = subprocess.run([str(binary), str(vectors), str(rounds)], check=True, capture_output=True,
                              text=True).stdout
    values = {}
    for line in text.splitlines():
        name, value = line.split()
        values[name] = float(value)
    return values


def time_calls(contexts: list[int], rounds: int, dtype: str) -> list[dict[str, object]]:
    """Median thread CPU time (ms) of, per S: a forward's 30 `hspec::attention` calls for a decode and for an
    8-token verify, one per layer over that layer's own K/V (47 MB at 2,048 keys, so they come from memory
    as a forward's do), and the target's whole 8-token verify forward over a pool of S positions; all
    interleaved round by round."""
    g = torch.Generator().manual_seed(0)
    target = load_target("smollm2", dtype=dtype)
    model = target.model.eval()
    c = model.config
    if (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) != (LAYERS, HQ, HKV, DIM):
        raise SystemExit(f"expected SmolLM2-135M's attention shapes, got {c}")
    calls = {}
    ids = torch.randint(0, c.vocab_size, (1, TOKENS), generator=g)
    for s in contexts:
        layers = pool_layers(s, g)
        for kind, t in (("decode", 1), ("verify", TOKENS)):
            q, mask = causal_queries(t, s, g)
            forward = [(q, k, v, mask, s) for k, v in layers]
            calls[(s, f"{kind}: 30 attention calls")] = lambda forward=forward: [
                torch.ops.hspec.attention(*args) for args in forward]
        pool = model.new_pool(pages_for(s + TOKENS, 16), 16)  # the target's own (bf16) pool, random K/V
        pool.add_sequence(0)
        pool.k[:, : s + TOKENS].copy_(torch.randn(pool.k[:, : s + TOKENS].shape, generator=g))
        pool.v[:, : s + TOKENS].copy_(torch.randn(pool.v[:, : s + TOKENS].shape, generator=g))
        pool.extend([0], s)
        calls[(s, "verify: the whole forward")] = lambda pool=pool, s=s: (model(ids, pool, [0]), pool.truncate(0, s))
    times: dict[tuple[int, str], list[float]] = {key: [] for key in calls}
    with torch.inference_mode():
        for call in calls.values():
            call()
        for _ in range(rounds):
            for key, call in calls.items():
                start = time.thread_time()
                call()
                times[key].append(time.thread_time() - start)
    return [{"S": s, "call": name, "ms": 1e3 * statistics.median(t)} for (s, name), t in times.items()]


def arithmetic(probe: dict[str, float], kernel: list[dict[str, object]]) -> dict[str, object]:
    """The extra multiply-adds of a verify at 2,048 keys over 256, the milliseconds each rate takes for them, and
    what 1.3x of this run's verify forward at 256 keys allows."""
    extra = PAIRS * ROWS * DIM * 2 * (2048 - 256)  # scores and value sums
    rates = {"fp32 FMA, peak (zmm)": probe["products_per_ns_fma_zmm_16"],
             "vdpbf16ps, peak (zmm)": probe["products_per_ns_dpbf16_zmm_16"],
             "fp32 FMA, verify score tile": probe["verify_scores_fma_products_per_ns"],
             "vdpbf16ps, verify score tile": probe["verify_scores_dot_products_per_ns"]}
    if "products_per_ns_tdpbf16ps" in probe:
        rates["AMX tdpbf16ps, peak"] = probe["products_per_ns_tdpbf16ps"]
    kernel_ms = {row["S"]: row["ms"] for row in kernel if row["call"].startswith("verify: 30")}
    forward_ms = {row["S"]: row["ms"] for row in kernel if row["call"] == "verify: the whole forward"}
    return {"extra_multiply_adds": extra, "verify_256_ms": forward_ms[256],
            "kernel_extra_ms": kernel_ms[2048] - kernel_ms[256],
            "forward_extra_ms": forward_ms[2048] - forward_ms[256],
            "forward_ratio": forward_ms[2048] / forward_ms[256],
            # one verify call at 2,048 keys: its scores' and value sums' multiply-adds a ns of its time
            "kernel_verify_2048_products_per_ns": LAYERS * HQ * TOKENS * 2048 * DIM * 2 / (1e6 * kernel_ms[2048]),
            "allowed_extra_ms": (GOAL - 1) * forward_ms[256],
            "extra_ms_at": {name: extra / rate / 1e6 for name, rate in rates.items()}}


def markdown(payload: dict) -> str:
    p, a = payload["probe"], payload["arithmetic"]
    lines = ["# vdpbf16ps and AMX against the fp32 FMA, for a long verify's attention", "",
             provenance_markdown(payload["provenance"]), "",
             f"- load average (1, 5, 15 min) before {payload['load_average']['before']}, after "
             f"{payload['load_average']['after']}", "",
             "## 1. What vdpbf16ps computes", "",
             f"{int(p['semantics_lanes']):,} lanes of random operands ({int(p['semantics_denormal_inputs']):,} "
             f"denormal bf16 inputs, {int(p['semantics_nan_lanes']):,} NaN results):", "",
             "| model | lanes that differ from the instruction |", "|---|---:|",
             f"| acc + a1 b1, then + a0 b0; one rounding each (nearest even), denormals in and out as 0 "
             f"| {int(p['mismatch_odd_first_model'])} |",
             f"| the same, even pair first | {int(p['mismatch_even_first_model'])} |",
             f"| AVX2 replay: vfmadd231ps (odd), vfmadd231ps (even) under MXCSR DAZ and FTZ "
             f"| {int(p['mismatch_avx2_replay'])} |", "",
             "## 2. Rates (thread CPU time, medians of interleaved rounds)", "",
             "| instruction | ns an instruction | multiply-adds a ns |", "|---|---:|---:|"]
    for name, label in (("fma_zmm_16", "vfmadd231ps zmm, 16 accumulators"),
                        ("fma_zmm_24", "vfmadd231ps zmm, 24 accumulators"),
                        ("dpbf16_zmm_16", "vdpbf16ps zmm, 16 accumulators"),
                        ("dpbf16_zmm_24", "vdpbf16ps zmm, 24 accumulators"),
                        ("fma_ymm_12", "vfmadd231ps ymm, 12 accumulators"),
                        ("dpbf16_ymm_16", "vdpbf16ps ymm, 16 accumulators")):
        lines.append(f"| {label} | {p['ns_per_instruction_' + name]:.3f} | {p['products_per_ns_' + name]:.1f} |")
    if p.get("amx"):
        lines.append(f"| AMX tdpbf16ps, 4 accumulator tiles | {p['ns_per_instruction_tdpbf16ps']:.3f} | "
                     f"{p['products_per_ns_tdpbf16ps']:.1f} |")
    lines += ["", "## 3. A verify's scores, one (layer, KV head): 24 rows x 2,048 bf16 keys x D = 64, tiles of 6 "
              "rows x 64 keys", "",
              "| form | us | multiply-adds a ns |", "|---|---:|---:|",
              f"| fp32 FMA (keys widened) | {p['verify_scores_fma_us']:.1f} | "
              f"{p['verify_scores_fma_products_per_ns']:.1f} |",
              f"| vdpbf16ps (dims paired by vpermt2w) | {p['verify_scores_dot_us']:.1f} | "
              f"{p['verify_scores_dot_products_per_ns']:.1f} |", "",
              f"The dot form's scores against its AVX2 replay: {int(p['verify_scores_replay_mismatches'])} differ; "
              f"against the FMA form's: largest difference {p['verify_scores_max_abs_change']:.3g} (scores up to "
              f"{p['verify_scores_max_abs']:.3g})."]
    if p.get("amx"):
        lines += ["", "## 4. What AMX's tdpbf16ps computes", "",
                  f"{int(p['amx_lanes']):,} lanes of random tiles: {int(p['amx_mismatch_stepwise_model']):,} differ "
                  f"from the step-by-step model of 1.; of {int(p['amx_moderate_lanes']):,} lanes of moderate "
                  f"operands (no denormal, no overflow), {int(p['amx_moderate_mismatch_stepwise_model']):,} "
                  f"differ from it and {int(p['amx_moderate_mismatch_sum_then_add']):,} from the 32 products "
                  "summed in fp32 in order, then added to the accumulator."]
    lines += ["", "## The arithmetic to 1.3x", "",
              f"An 8-token verify at 2,048 keys does {a['extra_multiply_adds'] / 1e6:.1f} M multiply-adds more than "
              f"one at 256 keys; the whole verify forward at 256 keys took {a['verify_256_ms']:.1f} ms (5.), "
              f"so 1.3x allows {a['allowed_extra_ms']:.1f} ms more.", "",
              "| those multiply-adds at | ms |", "|---|---:|"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in a["extra_ms_at"].items()]
    lines += ["", "## 5. hspec's attention kernel (bf16 pool, 9 query heads over 3 KV heads, D = 64) and the whole "
              f"verify forward ({payload['provenance']['settings']['dtype']} SmolLM2-135M), interleaved",
              "", "| S (keys) | what | ms (median thread CPU) |", "|---:|---|---:|"]
    lines += [f"| {row['S']} | {row['call']} | {row['ms']:.2f} |" for row in payload["kernel"]]
    lines += ["", f"The whole verify at 2,048 keys takes {a['forward_ratio']:.2f}x the one at 256 here (loaded), "
              f"{a['forward_extra_ms']:.2f} ms more; its 30 attention calls take {a['kernel_extra_ms']:.2f} ms more, "
              f"against {a['extra_ms_at']['fp32 FMA, peak (zmm)']:.2f} ms for their multiply-adds at "
              f"the FMA's measured peak. A verify call at 2,048 keys does "
              f"{a['kernel_verify_2048_products_per_ns']:.1f} of its multiply-adds a ns, "
              f"{a['kernel_verify_2048_products_per_ns'] / p['products_per_ns_fma_zmm_16']:.0%} of that peak "
              f"({p['verify_scores_fma_products_per_ns'] / p['products_per_ns_fma_zmm_16']:.0%} in the score tile "
              "of 3.)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vectors", type=int, default=2_000_000, help="random 512-bit operands for the semantics")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved timing rounds")
    parser.add_argument("--kernel-rounds", type=int, default=30,
                        help="interleaved rounds of the kernel's calls and the forwards")
    parser.add_argument("--dtype", default="w4a8", help="the target's dtype for the whole forward")
    parser.add_argument("--out", type=Path, default=Path("results/attention_scaling/bf16_dot"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    probe = run_probe(args.vectors, args.rounds)
    if not probe.get("avx512bf16"):
        raise SystemExit("this CPU lacks AVX512-BF16")
    if not load_kernels():
        raise SystemExit("hspec's CPU kernels do not run here")
    torch.set_num_threads(1)
    kernel = time_calls([256, 2048], args.kernel_rounds, args.dtype)
    load_after = os.getloadavg()
    command = (f"python scripts/bench_bf16_dot.py --vectors {args.vectors} --rounds {args.rounds} "
               f"--kernel-rounds {args.kernel_rounds} --dtype {args.dtype} --out {args.out}")
    payload = {"provenance": provenance(command, {"vectors": args.vectors, "rounds": args.rounds,
                                                  "kernel_rounds": args.kernel_rounds, "dtype": args.dtype,
                                                  "compiler": "gcc -O2", "threads": 1}),
               "load_average": {"before": load_before, "after": load_after}, "probe": probe, "kernel": kernel,
               "arithmetic": arithmetic(probe, kernel)}
    md = markdown(payload)
    json_path, md_path = write_results(args.out, "bf16_dot", payload, md)
    print(md)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
