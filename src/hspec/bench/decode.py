"""`hspec bench decode`: this runtime's plain decoding against transformers, and verify cost vs K.

1. Plain-decode time per token of our runtime (`--drafter none` path) and of transformers' eager
   `generate` on the same weights, prompts and token counts (EOS ignored so both emit exactly N),
   interleaved prompt by prompt so machine noise hits both alike. Reported as ratios ours / HF.
2. The cost of a (K+1)-token target forward (a verify) relative to a 1-token decode at the same
   context, for K = 3, 7, 15, interleaved.
3. The weight layout: the same forwards (1 token and K+1 tokens) with the runtime's column-major
   linear weights (models/weight_layout.py) and with a row-major copy of the target, interleaved.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch

from hspec.bench.report import provenance, provenance_markdown, write_results
from hspec.decoding.generate import SpeculativeDecoder
from hspec.decoding.sampling import SamplingParams
from hspec.drafters import create_drafter
from hspec.eval.tasks import load_task
from hspec.models.loading import load_target

VERIFY_KS = (3, 7, 15)


def run_decode_bench(target_name: str, num_prompts: int, max_new_tokens: int, repeats: int, out_dir: str) -> int:
    from transformers import AutoModelForCausalLM

    target = load_target(target_name)
    hf = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=torch.float32).eval()
    items = load_task("spec_bench", size=num_prompts).items
    prompts = [target.tokenizer.encode_prompt(item.turns[0]) for item in items]
    plain = SpeculativeDecoder(target.model, create_drafter("none", target.config), 1, eos_token_ids=())

    ours_s, hf_s = [], []
    with torch.inference_mode():
        plain.generate([prompts[0]], SamplingParams(), 4)  # warm-up both
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)
        for r in range(repeats):
            for i, ids in enumerate(prompts):
                t0 = time.perf_counter()
                plain.generate([ids], SamplingParams(), max_new_tokens)
                t1 = time.perf_counter()
                hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                            do_sample=False, pad_token_id=0)
                t2 = time.perf_counter()
                ours_s.append((t1 - t0) / max_new_tokens)
                hf_s.append((t2 - t1) / max_new_tokens)
                print(f"[decode] round {r + 1}/{repeats} prompt {i + 1}/{len(prompts)}: "
                      f"ours {1000 * ours_s[-1]:.1f} ms/tok, transformers {1000 * hf_s[-1]:.1f} ms/tok", flush=True)
        verify_ratios = _verify_costs(target.model, prompts[0], repeats * 5)
        layout_ms = _layout_costs(target.model, prompts[0], repeats * 5)

    ratios = [o / h for o, h in zip(ours_s, hf_s)]
    payload = {
        "provenance": provenance(
            f"hspec bench decode --num-prompts {num_prompts} --max-new-tokens {max_new_tokens} --repeats {repeats}",
            {"target": target.name, "dtype": "float32", "prompts": "spec_bench subset", "num_prompts": num_prompts,
             "max_new_tokens": max_new_tokens, "repeats": repeats}),
        "plain_decode": {
            "ours_ms_per_token": _summary([1000 * x for x in ours_s]),
            "transformers_ms_per_token": _summary([1000 * x for x in hf_s]),
            "ratio_ours_over_transformers": _summary(ratios),
            "goal": "ratio <= 1.0",
        },
        "verify_cost": {str(k): _summary(v) for k, v in verify_ratios.items()},
        "verify_goal": "K=7 (8 tokens) <= 1.8x a 1-token decode",
        "weight_layout_ms": {layout: {str(n): _summary(v) for n, v in per_n.items()}
                             for layout, per_n in layout_ms.items()},
    }
    md = ["# Plain decoding and verify cost on CPU\n", provenance_markdown(payload["provenance"]),
          "\n## Plain decode: time per token (prefill included, N tokens each, interleaved)\n",
          "| runtime | min | median | max |", "|---|---|---|---|"]
    for name, key in (("hspec (ms/token)", "ours_ms_per_token"), ("transformers generate (ms/token)",
                                                                  "transformers_ms_per_token"),
                      ("ratio hspec / transformers", "ratio_ours_over_transformers")):
        s = payload["plain_decode"][key]
        md.append(f"| {name} | {s['min']:.3f} | {s['median']:.3f} | {s['max']:.3f} |")
    md += ["\n## Verify of K+1 tokens relative to a 1-token decode (same context)\n",
           "| K | tokens | min | median | max |", "|---|---|---|---|---|"]
    for k, s in payload["verify_cost"].items():
        md.append(f"| {k} | {int(k) + 1} | {s['min']:.2f} | {s['median']:.2f} | {s['max']:.2f} |")
    md += ["\n## Weight layout: target forward time (ms, median) by new tokens, interleaved\n",
           "| tokens | row-major (out, in) | column-major (runtime) | column / row | "
           "row-major: ratio to 1 token | column-major: ratio to 1 token |", "|---|---|---|---|---|---|"]
    medians = {layout: {n: s["median"] for n, s in per_n.items()}
               for layout, per_n in payload["weight_layout_ms"].items()}
    for n in medians["row"]:
        row, col = medians["row"][n], medians["column"][n]
        md.append(f"| {n} | {row:.1f} | {col:.1f} | {col / row:.2f} | {row / medians['row']['1']:.2f} | "
                  f"{col / medians['column']['1']:.2f} |")
    json_path, md_path = write_results(Path(out_dir), "decode_cpu", payload, "\n".join(md) + "\n")
    print("\n".join(md))
    print(f"\nwrote {json_path} and {md_path}")
    return 0


def _verify_costs(model, prompt: list[int], rounds: int) -> dict[int, list[float]]:
    """Per K: ratios time(K+1-token forward) / time(1-token forward), both after the same prompt."""
    pool = _prefilled_pool(model, prompt)
    vocab = model.config.vocab_size
    ratios: dict[int, list[float]] = {k: [] for k in VERIFY_KS}
    _timed_forward(model, pool, torch.randint(0, vocab, (1, 1)))
    for _ in range(rounds):
        for k in VERIFY_KS:
            one = _timed_forward(model, pool, torch.randint(0, vocab, (1, 1)))
            ratios[k].append(_timed_forward(model, pool, torch.randint(0, vocab, (1, k + 1))) / one)
    return ratios


def _layout_costs(model, prompt: list[int], rounds: int) -> dict[str, dict[int, list[float]]]:
    """Milliseconds of 1- and (K+1)-token forwards after `prompt`, for the runtime's column-major
    weights and for a row-major copy of the same model, alternating between the two."""
    row_major = copy.deepcopy(model)
    for module in row_major.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(module.weight.detach().contiguous(), requires_grad=False)
    if model.lm_head.weight is model.embed_tokens.weight:
        row_major.embed_tokens.weight = row_major.lm_head.weight
    sizes = (1, *(k + 1 for k in VERIFY_KS))
    models = {"row": row_major, "column": model}
    pools = {layout: _prefilled_pool(m, prompt) for layout, m in models.items()}
    times: dict[str, dict[int, list[float]]] = {layout: {n: [] for n in sizes} for layout in models}
    for _ in range(rounds):
        for n in sizes:
            ids = torch.randint(0, model.config.vocab_size, (1, n))
            for layout, m in models.items():
                times[layout][n].append(1000 * _timed_forward(m, pools[layout], ids))
    return times


def _prefilled_pool(model, prompt: list[int]):
    """A pool holding sequence 0 with `prompt` cached and room for 32 more positions."""
    pool = model.new_pool(num_blocks=-(-(len(prompt) + 32) // 16))
    pool.add_sequence(0)
    model(torch.tensor([prompt]), pool, [0])
    return pool


def _timed_forward(model, pool, ids: torch.Tensor) -> float:
    """Seconds of one forward of `ids` (1, n) after the cached prompt; the pool is cut back after it."""
    base = pool.length(0)
    t = time.perf_counter()
    model(ids, pool, [0])
    elapsed = time.perf_counter() - t
    pool.truncate(0, base)
    return elapsed


def _summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}
