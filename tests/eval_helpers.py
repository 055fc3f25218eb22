"""Evaluation payloads as `hspec eval` writes them, small enough to reason about (the merge and table tests)."""

from __future__ import annotations


def record(method: str, item: int, num_accepted: list[int], decode_s: float, plain_s: float,
           plain_digest: str = "p", turn: int = 0) -> dict:
    tokens = 1 + sum(n + 1 for n in num_accepted) if num_accepted else 13
    return {"task": "spec_bench", "category": "qa", "item": f"spec_bench/{item}", "turn": turn, "method": method,
            "K": 7, "tokens": tokens, "decode_s": decode_s, "num_accepted": num_accepted,
            "plain_decode_s": plain_s, "plain_tokens": tokens, "plain_digest": f"{plain_digest}{item}/{turn}"}


def shard_payload(drafter: str, plain_s: float, num_accepted: list[int], speedup: float, items: int = 6,
          dtype: str = "bfloat16", **plain_digest) -> dict:
    """A shard: plain decoding taking `plain_s` a turn, and `drafter` `speedup` times faster than it."""
    records = []
    for i in range(items):
        accepted = [*num_accepted, i % 2]  # items differ, so the CIs have width
        digest = plain_digest.get(str(i), "p")
        records.append(record("none", i, [], plain_s, plain_s, digest))
        records.append(record(drafter, i, accepted, plain_s / speedup, plain_s, digest))
    settings = {"target": "tiny", "dtype": dtype, "K": 7, "temperature": 0.0, "max_new_tokens": 128,
                "tasks": "spec_bench", "size_per_task": items, "seed": 0, "methods": f"none,{drafter}",
                "checkpoints": {drafter: f"digest-of-{drafter}"}}
    provenance = {"command": "hspec eval (test)", "date": "d", "commit": "c", "tree_dirty": False,
                  "machine": {"platform": f"host-of-{drafter}", "cuda": None, "processor": "x", "cpu_count": 2,
                              "torch_threads": 2, "torch": "t"}, "settings": settings}
    return {"provenance": provenance, "summary": {}, "records": records}
