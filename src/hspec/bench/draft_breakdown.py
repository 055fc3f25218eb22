"""`hspec bench draft --breakdown`: where H-Spec's native greedy proposal spends its time.

For each context length S, a pool of one sequence of S positions and an H-Spec drafter with random weights
(as `hspec bench draft` sets them up), then per round, interleaved:

1. the target's 8-token verify (T_T), so the drafter's weights are as cold as between two decoding steps;
2. `propose(batch, K)` as decoding calls it (T_D);
3. the verify again, then the same proposal in its parts, through the code `propose` runs
   (`NeuralDrafter.native_drafts` with `timed`, then the `Proposal`): the native call timed by section
   (native_propose.cpp's `Section`, each summed over the drafter's layers); "native call, outside the sections"
   the rest of the call from its entry into C++ (the block, its RoPE and the context's views where it reads the
   pool in place, the weight cursor, the code between sections); "Python around the native call" what
   `native_drafts` spends outside C++ (the pool's window, the arguments and results through pybind11, or
   `block_context` where the context's slots are not consecutive); "proposal from drafts (Python)" the
   `Proposal` made of its outputs.

Every time is this thread's CPU time (run with one torch thread: what each part cost its core on a shared
CPU), medians over the rounds. Writes <out>/breakdown_<dtype>_drafter_<precision>.{json,md}.

Legend: K block, S context keys, Vp draft vocabulary.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from hspec.bench.draft import _create, _Setting
from hspec.drafters.base import Proposal
from hspec.models.loading import load_target
from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.runtime import drafter_precision_of, for_inference

AROUND, OUTSIDE, PROPOSAL = "Python around the native call", "native call, outside the sections", \
    "proposal from drafts (Python)"


def run_draft_breakdown(target_name: str, out_dir: str | Path, contexts: Sequence[int] = (256, 2048),
                        repeats: int = 10, K: int = 7, seed: int = 0, draft_vocab_size: int | None = 8192,
                        dtype: str = "w4a8", drafter_precision: str = "auto") -> int:
    """Time H-Spec's native proposal section by section against the target's verify; write the files."""
    target = load_target(target_name, dtype=dtype)
    model = target.model.eval()
    torch.manual_seed(seed)
    drafter = for_inference(_create("hspec", target.config, model, draft_vocab_size), target, False,
                            drafter_precision)
    native = drafter.native_greedy
    if native is None:
        raise RuntimeError("H-Spec's native proposal is not bound here (HSPEC_NATIVE_DRAFTER=0, a GPU, or the "
                           "extension did not build): nothing to break down")
    rows = []
    with torch.inference_mode():
        for S in contexts:
            rows.append(_measure(model, drafter, native, S, K, repeats, seed))
            print(f"[breakdown] S={S} T_D {rows[-1]['T_D_ms']:.2f} ms, T_T {rows[-1]['T_T_ms']:.2f} ms (CPU time)",
                  flush=True)
    settings = {"target": target.name, "dtype": model.dtype_name, "K": K, "contexts": list(contexts),
                "repeats": repeats, "draft_vocab_size": draft_vocab_size, "drafter_weights": "random",
                "drafter_precision": drafter_precision_of(drafter_precision, target),
                "threads": torch.get_num_threads(), "load_average": _load_average()}
    command = (f"hspec bench draft --breakdown --target {target_name} --contexts {','.join(map(str, contexts))} "
               f"--repeats {repeats} --draft-vocab {draft_vocab_size} --dtype {dtype}")
    command += f" --drafter-precision {drafter_precision}" if drafter_precision != "auto" else ""
    payload = {"provenance": provenance(command, settings), "results": rows}
    markdown = _markdown(payload)
    name = f"breakdown_{model.dtype_name}_drafter_{settings['drafter_precision']}"
    json_path, md_path = write_results(Path(out_dir), name, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {md_path}")
    return 0


def _measure(model, drafter, native, S: int, K: int, repeats: int, seed: int) -> dict:
    setting = _Setting(model, {"hspec": drafter}, 1, S, K, repeats, seed)
    batch = setting.batch
    verify, propose, parts = [], [], {}
    for round_ in range(repeats + 1):  # round 0 warms up
        first = _thread_ms(lambda: setting.time_verify())
        t_d = _thread_ms(lambda: drafter.propose(batch, K))
        second = _thread_ms(lambda: setting.time_verify())
        start = time.thread_time()
        out = drafter.native_drafts(native, batch, K, timed=True)
        after_call = time.thread_time()
        Proposal(out.drafts, None, confidence=out.confidence)  # as `propose` makes it
        end = time.thread_time()
        if round_ == 0:
            continue
        verify.append((first + second) / 2)
        propose.append(t_d)
        sections, (call, _) = native.section_times(out.timings)
        inside = sum(cpu for cpu, _ in sections.values())
        measured = {AROUND: 1e3 * (after_call - start) - call, **{name: cpu for name, (cpu, _) in sections.items()},
                    OUTSIDE: call - inside, PROPOSAL: 1e3 * (end - after_call)}
        for name, ms in measured.items():
            parts.setdefault(name, []).append(ms)
    setting.close()
    t_t, t_d = statistics.median(verify), statistics.median(propose)
    return {"S": S, "T_T_ms": t_t, "T_D_ms": t_d, "T_D_over_T_T": statistics.median(
                [d / v for d, v in zip(propose, verify, strict=True)]),
            "sections_ms": {name: statistics.median(values) for name, values in parts.items()},
            "sum_of_sections_ms": statistics.median([sum(r) for r in zip(*parts.values(), strict=True)])}


def _thread_ms(call) -> float:
    start = time.thread_time()
    call()
    return 1e3 * (time.thread_time() - start)


def _load_average() -> list[float] | None:
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def _markdown(payload: dict) -> str:
    lines = ["# H-Spec's native proposal, section by section\n", provenance_markdown(payload["provenance"]),
             "\nThread CPU time, medians of the rounds (module docstring of `hspec.bench.draft_breakdown`): T_T one "
             "8-token verify, T_D one `propose(K=7)`, the sections one proposal taken apart in the same round; "
             "each section summed over the drafter's layers. Where a section is a product (`*_proj`, `head`, "
             "`markov.w2_product`, `injection`), its weights come from memory as cold as between two steps.\n"]
    for row in payload["results"]:
        lines += [f"\n## context S = {row['S']}: T_D {row['T_D_ms']:.2f} ms, T_T {row['T_T_ms']:.2f} ms, T_D / T_T "
                  f"{row['T_D_over_T_T']:.3f}; the sections sum to {row['sum_of_sections_ms']:.2f} ms\n",
                  "| section | ms | share |", "|---|---|---|"]
        total = row["sum_of_sections_ms"]
        for name, ms in row["sections_ms"].items():
            lines.append(f"| {name} | {ms:.3f} | {100 * ms / total:.1f}% |")
    return "\n".join(lines) + "\n"
