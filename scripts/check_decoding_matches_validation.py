"""Does measured MAL on held-out training prompts equal the decode-order validation of the same sequences?

`hspec validate` (and `hspec train`) report a teacher-forced "tau in decode order" on held-out responses.
If training and decoding fed the drafter the same inputs, decoding those prompts with the drafter must
reproduce each sequence's validation tau (up to floating-point ties). A gap would mean a mismatch
between training and decoding; agreement means that a drafter's lower tau on another benchmark comes
from the text, not from the machinery. Features are computed online here (fp32), as decoding sees them.

    .venv/bin/python scripts/check_decoding_matches_validation.py [--drafter DIR] [--sequences 12]

Writes results/decoding_vs_validation.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters.common import kv_layer_of, select_target_layers
from hspec.models.loading import load_target
from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.runtime import build_drafter
from hspec.sampling import SamplingParams
from hspec.training.features import OnlineFeatures
from hspec.training.run import held_out_ids
from hspec.training.trainer import TrainConfig, Trainer

K = 7


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", default=None, help="H-Spec drafter dir (default: the shipped one)")
    parser.add_argument("--sequences", type=int, default=12, help="held-out sequences to decode (default 12)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()

    target = load_target("smollm2")
    corpora = [Path(f"results/train_data/corpus_part{i}.jsonl") for i in range(1, 14)]
    layers = select_target_layers(target.config.num_layers)
    store = OnlineFeatures(corpora, target.model, target.name, layers, [kv_layer_of(x) for x in layers])
    val_ids = held_out_ids(store, 24)[: args.sequences]
    drafter = build_drafter("hspec", target, args.drafter)
    trainer = Trainer(drafter, target.model, store.load, val_ids, TrainConfig(steps=1))
    decoder = SpeculativeDecoder(target.model, drafter, K, target.tokenizer.eos_token_ids)
    rows = []
    for i in tqdm(val_ids, desc="sequences", unit="seq"):
        record = store.records[i]
        validation = trainer.validate_in_decode_order([i])
        out = decoder.generate([record["prompt_ids"]], SamplingParams(), len(record["response_ids"]))
        rows.append({"id": record["id"], "response_tokens": len(record["response_ids"]),
                     "same_output": out.sequences[0].token_ids == record["response_ids"],
                     "validation_tau": validation.mean_accepted_length,
                     "decoding_tau": out.acceptance().mean_accepted_length})
    command = "python scripts/check_decoding_matches_validation.py " + " ".join(sys.argv[1:])
    meta = provenance(command.strip(), {"target": target.name, "drafter": args.drafter or "shipped", "K": K,
                                        "sequences": len(rows)})
    lines = [f"| `{r['id']}` | {r['response_tokens']} | {'yes' if r['same_output'] else 'no'} | "
             f"{r['validation_tau']:.2f} | {r['decoding_tau']:.2f} |" for r in rows]
    gaps = [abs(r["decoding_tau"] - r["validation_tau"]) for r in rows]
    markdown = (
        "# Measured MAL vs decode-order validation, held-out training sequences\n\n" + provenance_markdown(meta)
        + "\nEach held-out response (the target's own greedy output) is decoded again with the drafter, greedy, "
        f"K = {K}, for as many tokens as the response has; its measured MAL is set beside `hspec validate`'s "
        "teacher-forced tau in decode order for the same sequence (features computed online, fp32). Decoding "
        "runs to the end of the response, validation stops at the last block whose K labels all exist, so "
        "short responses may differ a little.\n\n"
        "| sequence | response tokens | decoded output = response | validation tau | decoding tau |\n"
        "|---|---|---|---|---|\n" + "\n".join(lines) + "\n\n"
        f"Largest gap {max(gaps):.2f}, mean gap {sum(gaps) / len(gaps):.3f} tokens per step.\n")
    json_path, md_path = write_results(args.out, "decoding_vs_validation", {"provenance": meta, "rows": rows},
                                       markdown)
    print(f"wrote {md_path}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(2)
    sys.exit(main())
