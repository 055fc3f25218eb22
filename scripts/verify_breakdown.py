"""Where a w4a8 verify's time goes, part by part, against a 1-token decode's (issue 50, item 4).

For SmolLM2-135M in `--dtype w4a8` at each context S (a random prompt prefilled, then T new tokens forwarded and
rolled back, T = 1, 4, 8 in turn within every round), each round times:

1. the step as decoding runs it: `TargetModel.forward` then `sampling.greedy_tokens`, and inside the forward the
   native decoder stack's call and the final norm + LM head (hooks), the rest of the forward being Python around them;
2. the greedy argmax two ways on the step's logits: torch's (`logits.float().argmax(-1)`, the code before
   `hspec::greedy_tokens`) and `greedy_tokens` as it runs now (the A/B of that change, interleaved);
3. the stack's parts replayed one operator at a time with the step's shapes and the target's own weights, each
   kind over all 30 layers (so the weights stream as in the forward): the four w4a8 products (q/k/v, o, gate/up,
   down), the attention over the pool at S keys, the two RMSNorms, RoPE with the KV writes. The stack's time
   less these is its glue (SiLU, the products' adds and chunks, the dispatcher, the loop).

Clock: the calling thread's CPU time at one thread (the host is shared, so wall time mostly measures the
others), wall time otherwise (a second thread's work is not on the calling thread's clock). Medians over rounds.

    python scripts/verify_breakdown.py [--contexts 256,2048] [--tokens 1,4,8] [--rounds 15] [--threads 1]

Writes results/verify_breakdown/verify_breakdown_t{threads}.{json,md}. Legend: T new tokens (rows), S keys.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from hspec.cache.paged_pool import pages_for
from hspec.models.layers import _KEY_MULTIPLE
from hspec.models.loading import load_target
from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.sampling import greedy_tokens

# The products of one layer: (name, attribute path of its w4a8 tiles on a DecoderLayer), the LM head apart.
_PRODUCTS = (("q/k/v", ("self_attn", "qkv", "qkv_packed")), ("o", ("self_attn", "o_proj", "weight_packed")),
             ("gate/up", ("mlp", "gate_up_packed")), ("down", ("mlp", "down_proj", "weight_packed")))


class _TimedStack:
    """The target's NativeDecoderStack with its calls timed and their arguments kept for the replay."""

    def __init__(self, stack, clock) -> None:
        self.stack, self.clock = stack, clock
        self.seconds = 0.0
        self.args: tuple = ()

    def covers(self, x, node_tables):
        return self.stack.covers(x, node_tables)

    def __call__(self, *args):
        self.args = args
        start = self.clock()
        out = self.stack(*args)
        self.seconds = self.clock() - start
        return out


def _timed(clock, call) -> float:
    start = clock()
    call()
    return clock() - start


def _attribute(layer, path: tuple[str, ...]):
    for name in path:
        layer = getattr(layer, name)
    return layer


def _step(model, pool, ids: torch.Tensor, start: int, timed: _TimedStack, head: dict, clock) -> dict[str, float]:
    """One decode or verify of ids (1, T) after `start` keys, then rolled back; its parts in seconds."""
    t0 = clock()
    out = model.forward(ids, pool, [0])
    t1 = clock()
    tokens = greedy_tokens(out.logits)
    t2 = clock()
    old = _timed(clock, lambda: out.logits.float().argmax(-1))
    assert torch.equal(tokens, out.logits.float().argmax(-1))  # the kernel's tokens are torch's
    pool.truncate(0, start)
    forward = t1 - t0
    return {"forward": forward, "stack": timed.seconds, "norm + LM head": head["seconds"],
            "Python around the stack and head": forward - timed.seconds - head["seconds"],
            "argmax (greedy_tokens)": t2 - t1, "argmax (torch, .float().argmax)": old, "step": t2 - t0}


def _replay(model, args: tuple, clock) -> dict[str, float]:
    """The stack's operators one kind at a time over all layers, with the step's shapes (`args`: its call)."""
    x, cos, sin, pool_k, pool_v, capacity, write_slots, slots, contiguous_start, mask, _ = args
    t, h = x.shape[1], x.shape[2]
    c = model.config
    hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
    s = slots.shape[1]
    width = s + -s % _KEY_MULTIPLE
    start = contiguous_start
    key_end = start + width if start + width <= capacity else start + s
    gen = torch.Generator().manual_seed(t)
    rows = torch.randn(t, h, generator=gen).bfloat16()  # (T, H)
    parts = {}
    for name, path in _PRODUCTS:
        weights = [_attribute(layer, path) for layer in model.layers]
        k_in = c.intermediate_size if name == "down" else h
        inputs = torch.randn(t, k_in, generator=gen).bfloat16()
        parts[f"product {name}"] = _timed(clock, lambda w=weights, x_=inputs: [torch.ops.hspec.w4a8_linear(x_, wi)
                                                                               for wi in w])
    norms = [g for layer in model.layers for g in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
    parts["RMSNorm x2"] = _timed(clock, lambda: [torch.ops.hspec.rms_norm(rows, g, c.rms_norm_eps) for g in norms])
    projected = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).bfloat16()  # (T, (Hq + 2 Hkv) D)
    flat_slots = write_slots.reshape(-1)
    parts["RoPE + KV write"] = _timed(clock, lambda: [torch.ops.hspec.rope_and_write(
        projected, cos, sin, pool_k[i], pool_v[i], flat_slots, hq, hkv) for i in range(c.num_layers)])
    queries = torch.randn(1, t, hq, d, generator=gen).bfloat16()  # (1, T, Hq, D)
    parts["attention"] = _timed(clock, lambda: [torch.ops.hspec.attention(
        queries, pool_k[i, start:key_end].unsqueeze(0), pool_v[i, start:key_end].unsqueeze(0), mask, s)
        for i in range(c.num_layers)])
    return parts


def _measure(model, context: int, tokens: list[int], rounds: int, clock) -> dict:
    gen = torch.Generator().manual_seed(context)
    pool = model.new_pool(num_pages=pages_for(context + max(tokens), 16))
    pool.add_sequence(0)
    model.prefill(torch.randint(0, model.config.vocab_size, (1, context), generator=gen), pool, [0],
                  last_logits_only=True)
    timed = _TimedStack(model.native, clock)
    head: dict[str, float] = {"seconds": 0.0}
    hooks = [model.norm.register_forward_pre_hook(lambda *_: head.__setitem__("start", clock())),
             model.lm_head.register_forward_hook(lambda *_: head.__setitem__("seconds", clock() - head["start"]))]
    model.native = timed
    samples: dict[int, dict[str, list[float]]] = {t: defaultdict(list) for t in tokens}
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for t in tokens:
                ids = torch.randint(0, model.config.vocab_size, (1, t), generator=gen)
                parts = _step(model, pool, ids, context, timed, head, clock)
                parts.update(_replay(model, timed.args, clock))
                pool.truncate(0, context)  # the replay's KV writes
                if r > 0:
                    for name, seconds in parts.items():
                        samples[t][name].append(1e3 * seconds)
    finally:
        model.native = timed.stack
        for hook in hooks:
            hook.remove()
    medians = {t: {name: statistics.median(v) for name, v in per.items()} for t, per in samples.items()}
    for per in medians.values():
        replayed = sum(v for name, v in per.items() if name.startswith(("product", "RMSNorm", "RoPE", "attention")))
        per["stack glue (stack less the replayed parts)"] = per["stack"] - replayed
    return medians


def _arithmetic(config) -> dict[str, int]:
    """Multiply-adds per row of each product kind over all layers, and of the LM head."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    qkv = h * (config.num_heads + 2 * config.num_kv_heads) * d
    per_layer = {"q/k/v": qkv, "o": config.num_heads * d * h, "gate/up": h * 2 * i, "down": i * h}
    out = {f"product {k}": v * config.num_layers for k, v in per_layer.items()}
    out["LM head"] = h * config.vocab_size
    return out


def _markdown(payload: dict) -> str:
    lines = ["# A w4a8 verify's time, part by part, against a decode's", "", provenance_markdown(payload["provenance"]),
             "", f"Clock: {payload['clock']}; medians of {payload['rounds']} rounds, ms. Load average before/after: "
             f"{payload['load_before']} / {payload['load_after']}. `x decode` = the part at T rows over the same part "
             "at 1 row; `per extra row` = (part at T - part at 1) / (T - 1).", ""]
    for context, per_t in payload["results"].items():
        tokens = sorted(int(t) for t in per_t)
        names = list(per_t[str(tokens[0])])
        header = "| part | " + " | ".join(f"T={t}" for t in tokens) + " | " + " | ".join(
            f"T={t} x decode | per extra row (T={t})" for t in tokens if t > 1) + " |"
        lines += [f"## {context} keys", "", header, "|---" * (1 + len(tokens) + 2 * (len(tokens) - 1)) + "|"]
        for name in names:
            base = per_t["1"][name] if "1" in per_t else None
            cells = [f"{per_t[str(t)][name]:.3f}" for t in tokens]
            for t in tokens:
                if t == 1:
                    continue
                value = per_t[str(t)][name]
                ratio = f"{value / base:.2f}" if base and base > 0.005 else "-"
                extra = f"{(value - base) / (t - 1):.3f}" if base is not None else "-"
                cells += [ratio, extra]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Multiply-adds per row (all layers): " + ", ".join(
        f"{k} {v / 1e6:.1f} M" for k, v in payload["multiply_adds_per_row"].items()), ""]
    return "\n".join(lines)


def _load() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="256,2048", help="keys before the new tokens (default 256,2048)")
    parser.add_argument("--tokens", default="1,4,8", help="rows T of a step, 1 = a decode (default 1,4,8)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds after one warm-up (default 15)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--out", type=Path, default=Path("results/verify_breakdown"))
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    if 1 not in tokens:
        parser.error("--tokens must include 1 (the decode every part is compared with)")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    target = load_target("smollm2", dtype="w4a8")
    load_before = _load()
    results = {}
    with torch.inference_mode():
        for context in (int(c) for c in args.contexts.split(",")):
            results[context] = {str(t): per for t, per in _measure(target.model, context, tokens, args.rounds,
                                                                     clock).items()}
    command = "python scripts/verify_breakdown.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = provenance(command.strip(), {"target": "SmolLM2-135M-Instruct", "dtype": "w4a8", "contexts": args.contexts,
                                        "tokens": tokens, "rounds": args.rounds, "threads": args.threads})
    payload = {"provenance": meta, "clock": "thread CPU time" if args.threads == 1 else "wall time",
               "rounds": args.rounds, "load_before": load_before, "load_after": _load(),
               "multiply_adds_per_row": _arithmetic(target.model.config), "results": results}
    markdown = _markdown(payload)
    json_path, md_path = write_results(args.out, f"verify_breakdown_t{args.threads}", payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
