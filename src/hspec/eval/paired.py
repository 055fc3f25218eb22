"""Records of one evaluation paired by prompt, and the ratios compared over them.

A prompt is one turn of one item, run by every method of an evaluation; each record of it carries the
method's tokens, decode time and accepted drafts per step, and the plain decoding it ran beside. The
paired bootstrap (`eval/bootstrap.py`) resamples prompts, so each statistic here is a ratio of sums over
prompts (`RatioOfSums`): the summary of `hspec eval`, the lab's claims and its merged shards all compare
drafters through these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hspec.eval.bootstrap import RatioOfSums


def records_by_prompt(records: Sequence[dict[str, Any]]) -> dict[str, dict[tuple, dict[str, Any]]]:
    """method -> (task, item, turn) -> record."""
    out: dict[str, dict[tuple, dict[str, Any]]] = {}
    for r in records:
        out.setdefault(r["method"], {})[(r["task"], r["item"], r["turn"])] = r
    return out


def tau_ratio(units: Sequence[dict[str, Any]]) -> RatioOfSums:
    """tau over prompts as a ratio of sums: tokens emitted by drafted steps / steps. A prompt that
    ran no step (it ended at the first token) counts as one step emitting one token."""
    num = np.array([sum(n + 1 for n in u["num_accepted"]) if u["num_accepted"] else 1 for u in units], dtype=float)
    den = np.array([max(len(u["num_accepted"]), 1) for u in units], dtype=float)
    return RatioOfSums(num, den)


def itl_ratio(units: Sequence[dict[str, Any]]) -> RatioOfSums:
    """Time per token over prompts as a ratio of sums: decode seconds / tokens after the first."""
    return RatioOfSums(np.array([u["decode_s"] for u in units], dtype=float),
                       np.array([max(u["tokens"] - 1, 1) for u in units], dtype=float))


def speedup_ratio(units: Sequence[dict[str, Any]]) -> RatioOfSums:
    """Speedup over the plain decoding each record was interleaved with, as a ratio of sums: the time plain
    decoding's ITL gives the record's tokens / the record's decode seconds. Needs the records' own plain
    timing (`plain_decode_s`, `plain_tokens`, which `hspec eval` records), so records of evaluations run
    apart (the shards of a merged evaluation, `lab/merge.py`) compare by their own plain decoding."""
    plain_itl = np.array([u["plain_decode_s"] / max(u["plain_tokens"] - 1, 1) for u in units], dtype=float)
    tokens = np.array([max(u["tokens"] - 1, 1) for u in units], dtype=float)
    return RatioOfSums(plain_itl * tokens, np.array([u["decode_s"] for u in units], dtype=float))


def speed_pair(ahead: Sequence[dict[str, Any]], behind: Sequence[dict[str, Any]]) -> tuple[RatioOfSums, RatioOfSums]:
    """Two ratios whose relative difference is speedup(ahead) / speedup(behind) - 1 on paired records.

    With every record's own plain timing, each side's speedup over its own plain decoding; without it
    (records made before `hspec eval` kept it), ITL(behind) / ITL(ahead), which is the same number when
    both ran beside one plain decoding and emitted the same tokens.
    """
    if all("plain_decode_s" in u for u in (*ahead, *behind)):
        return speedup_ratio(ahead), speedup_ratio(behind)
    return itl_ratio(behind), itl_ratio(ahead)


def same_plain(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two records decoded after the same plain output: `plain_digest` (of plain decoding's tokens on
    the record's turn) equal, or absent from either. Under greedy decoding a drafter's output is plain's, and a
    later turn's prompt holds the earlier turns' plain answers, so two shards whose plain decoding parted on a
    prompt (another CPU's kernels) ran their drafters on other text there, and are not paired on it."""
    return a.get("plain_digest") is None or b.get("plain_digest") is None or a["plain_digest"] == b["plain_digest"]


def paired_records(per_method, methods: list[str]) -> list[list[dict[str, Any]]]:
    """Each method's records on the prompts every one of them ran after the same plain output (`same_plain`),
    in one prompt order."""
    keys = sorted(key for key in set.intersection(*(set(per_method[m]) for m in methods))
                  if all(same_plain(per_method[methods[0]][key], per_method[m][key]) for m in methods[1:]))
    return [[per_method[m][key] for key in keys] for m in methods]
