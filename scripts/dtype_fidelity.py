"""How close does each `--dtype` stay to the float32 model? (docs/fast-path.md)

bf16, int8, int4 and w4a8 are models of their own: speculative decoding in each is lossless against plain
decoding of the same dtype, but their outputs differ from float32's. This measures by how much, on
Spec-Bench prompts: float32 decodes each answer greedily one token at a time (the reference path); every
other dtype then decodes the same tokens one at a time after the same prompt, and at each position we
compare its next-token distribution with float32's:

- top-1 agreement: the share of positions whose greedy token is float32's;
- KL(float32 || dtype) of the next-token distributions, in nats, averaged over positions;
- tokens before the first difference: how long that dtype's own greedy output equals float32's (both
  decode the same prefix until their greedy tokens first differ), capped at --tokens.

    .venv/bin/python scripts/dtype_fidelity.py [--dtypes bfloat16,int8,int4,w4a8] [--items 12] [--tokens 64]

Writes results/dtype_fidelity/dtype_fidelity.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from hspec.cache.paged_pool import pages_for
from hspec.data.tasks import load_task
from hspec.models.llama import TargetModel
from hspec.models.loading import load_target
from hspec.provenance import provenance, provenance_markdown, write_results


def next_token_log_probs(model: TargetModel, prompt: list[int], path: list[int]) -> torch.Tensor:
    """(len(path), V) fp32 log-probabilities of the next token after the prompt and each prefix of `path`
    but the whole (a prefill, then one 1-token decode per token of `path[:-1]`, as plain decoding runs)."""
    pool = model.new_pool(num_pages=pages_for(len(prompt) + len(path) + 1, 16))
    pool.add_sequence(0)
    logits = [model.prefill(torch.tensor([prompt]), pool, [0], last_logits_only=True).logits[0, -1]]
    for token in path[:-1]:
        logits.append(model(torch.tensor([[token]]), pool, [0]).logits[0, -1])
    return torch.log_softmax(torch.stack(logits).float(), dim=-1)


def greedy_path(model: TargetModel, prompt: list[int], tokens: int) -> list[int]:
    """`tokens` greedy tokens after `prompt`, decoded one at a time (no stop at EOS: a fixed length)."""
    pool = model.new_pool(num_pages=pages_for(len(prompt) + tokens + 1, 16))
    pool.add_sequence(0)
    path = [int(model.prefill(torch.tensor([prompt]), pool, [0], last_logits_only=True).logits[0, -1].argmax())]
    while len(path) < tokens:
        path.append(int(model(torch.tensor([[path[-1]]]), pool, [0]).logits[0, -1].argmax()))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,int8,int4,w4a8",
                        help="comma-separated dtypes compared with float32 (default bfloat16,int8,int4,w4a8)")
    parser.add_argument("--items", type=int, default=12, help="Spec-Bench items, evenly spaced (default 12)")
    parser.add_argument("--tokens", type=int, default=64,
                        help="tokens of float32's greedy answer per item (default 64)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--out", type=Path, default=Path("results/dtype_fidelity"))
    args = parser.parse_args(argv)
    if args.items < 1 or args.tokens < 1:
        parser.error(f"--items and --tokens must be at least 1; got {args.items} and {args.tokens}")
    dtypes = args.dtypes.split(",")
    if "float32" in dtypes:
        parser.error("--dtypes lists the dtypes compared with float32, the reference; leave float32 out")
    torch.set_num_threads(args.threads)
    items = load_task("spec_bench", args.items).items
    with torch.inference_mode():
        reference = load_target("smollm2", dtype="float32")
        prompts = [reference.tokenizer.encode_chat([{"role": "user", "content": item.turns[0]}]) for item in items]
        paths, references = [], []
        for prompt in tqdm(prompts, desc="float32", unit="item"):
            paths.append(greedy_path(reference.model, prompt, args.tokens))
            references.append(next_token_log_probs(reference.model, prompt, paths[-1]))
        del reference
        results = {}
        for dtype in dtypes:
            model = load_target("smollm2", dtype=dtype).model
            agree, kl, first = [], [], []
            for prompt, path, expected in tqdm(list(zip(prompts, paths, references)), desc=dtype, unit="item"):
                got = next_token_log_probs(model, prompt, path)
                same = got.argmax(-1) == torch.tensor(path)
                agree.append(float(same.float().mean()))
                kl.append(float((expected.exp() * (expected - got)).sum(-1).mean()))
                differ = (~same).nonzero()
                first.append(len(path) if len(differ) == 0 else int(differ[0, 0]))
            results[dtype] = {"top1_agreement": statistics.mean(agree), "kl_nats": statistics.mean(kl),
                              "tokens_before_first_difference": statistics.mean(first),
                              "per_item_first_difference": first}
    command = "python scripts/dtype_fidelity.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = provenance(command.strip(), {"target": "SmolLM2-135M-Instruct", "reference": "float32",
                                        "dtypes": dtypes, "items": [i.id for i in items], "tokens": args.tokens,
                                        "threads": args.threads})
    lines = ["# Each dtype against the float32 model, along float32's greedy answers", "", provenance_markdown(meta),
             "", f"{len(items)} Spec-Bench prompts, {args.tokens} tokens of float32's greedy answer each.", "",
             "| dtype | top-1 agreement | KL(float32 ‖ dtype), nats | tokens before the first difference (mean) |",
             "|---|---|---|---|"]
    for dtype, r in results.items():
        lines.append(f"| {dtype} | {r['top1_agreement']:.4f} | {r['kl_nats']:.5f} | "
                     f"{r['tokens_before_first_difference']:.1f} of {args.tokens} |")
    lines += ["", "Speculative decoding is lossless within each dtype; this is how far each dtype's model is from "
              "float32's (docs/fast-path.md).", ""]
    json_path, md_path = write_results(args.out, "dtype_fidelity", {"provenance": meta, "results": results},
                                       "\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
