"""The paper's three comparative claims, tested on the records of one evaluation.

1. H-Spec leads the baselines (DSpark, DFlash, DFlash with direct KV reuse, P-Eagle, and the
   model-free n-gram drafter) on tau and on decode speed.
2. Direct KV reuse alone decays at later block positions: a drafter whose attention reads the
   target's cached K/V as its only context loses more conditional acceptance at positions 2..K than
   at position 1, compared with a drafter that has another context source (DFlash's own context
   K/V, or H-Spec's Mamba state).
3. Both context sources are needed: H-Spec beats its single-source ablations on tau.

Every test is a paired bootstrap over prompts (one prompt = one turn of one item, run by every
method), so each finding carries a 95% CI, and its verdict says whether the CI lies on the side the
paper predicts ("supports"), on the other side ("contradicts"), or spans zero ("unresolved"). A
claim is tested only when its methods were in the run under their kind names (e.g. `hspec`,
`dflash-kvreuse`), which is how `scripts/compare_smollm2.sh` labels them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hspec.eval.bootstrap import BootstrapCI, RatioOfSums, paired_bootstrap, paired_bootstrap_relative_diff

BASELINES = ("dspark", "dflash", "dflash-kvreuse", "peagle", "ngram")
# (KV-reuse-only drafter, the reference it is compared with position by position)
KV_REUSE_PAIRS = (("dflash-kvreuse", "dflash"), ("dflash-kvreuse", "hspec"), ("hspec-kvreuse-only", "hspec"))
SINGLE_SOURCE_ABLATIONS = ("hspec-lasttoken-only", "hspec-kvreuse-only")
FIRST_LATE_POSITION = 2  # "later" block positions are 2..K (1-based): reached often even by weak drafters


@dataclass(frozen=True)
class Finding:
    claim: str  # which of the paper's claims this tests
    comparison: str  # e.g. "hspec vs dspark"
    metric: str  # what the estimate measures, in words
    ci: BootstrapCI
    prompts: int  # paired prompts the bootstrap resampled
    paper_sign: int  # +1: the paper predicts estimate > 0; -1: < 0

    @property
    def verdict(self) -> str:
        if self.ci.low > 0 or self.ci.high < 0:
            return "supports" if (self.ci.low > 0) == (self.paper_sign > 0) else "contradicts"
        return "unresolved"

    def to_dict(self) -> dict[str, Any]:
        return {"claim": self.claim, "comparison": self.comparison, "metric": self.metric,
                "ci": self.ci.to_dict(), "prompts": self.prompts, "paper_sign": self.paper_sign,
                "verdict": self.verdict}


def evaluate_claims(records: Sequence[dict[str, Any]], K: int, seed: int = 0) -> list[Finding]:
    """Every claim whose methods are among the records' labels (K: the draft length of the run)."""
    per_method = records_by_prompt(records)
    present = set(per_method)
    findings: list[Finding] = []
    if "hspec" in present:
        for baseline in (b for b in BASELINES if b in present):
            ours, theirs = paired_records(per_method, ["hspec", baseline])
            tau = paired_bootstrap_relative_diff(tau_ratio(ours), tau_ratio(theirs), seed=seed)
            speed = paired_bootstrap_relative_diff(*speed_pair(ours, theirs), seed=seed)
            findings.append(Finding("H-Spec leads", f"hspec vs {baseline}", "tau, relative difference", tau,
                                    len(ours), +1))
            findings.append(Finding("H-Spec leads", f"hspec vs {baseline}",
                                    "decode speed (hspec speedup / baseline speedup - 1)", speed, len(ours), +1))
        for ablation in (a for a in SINGLE_SOURCE_ABLATIONS if a in present):
            ours, theirs = paired_records(per_method, ["hspec", ablation])
            tau = paired_bootstrap_relative_diff(tau_ratio(ours), tau_ratio(theirs), seed=seed)
            findings.append(Finding("both context sources needed", f"hspec vs {ablation}",
                                    "tau, relative difference", tau, len(ours), +1))
    if K >= FIRST_LATE_POSITION:
        late = range(FIRST_LATE_POSITION, K + 1)
        for reuse, reference in ((r, f) for r, f in KV_REUSE_PAIRS if r in present and f in present):
            columns = np.array([[c for record in prompt for c in _acceptance_columns(record, late)]
                                for prompt in zip(*paired_records(per_method, [reuse, reference]))])  # (N, 8)
            reached_all = (columns[:, 1::2] > 0).all(axis=1)  # every pooled acceptance has a denominator
            columns = columns[reached_all]
            if len(columns) < 2:
                continue
            findings.append(Finding(
                "direct KV reuse decays at later positions", f"{reuse} vs {reference}",
                f"acceptance gap at positions {late.start}-{late.stop - 1} minus gap at position 1 (points)",
                paired_bootstrap(columns, _gap_widening, seed=seed), len(columns), -1))
    return findings


def render_findings(findings: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown lines: one row per finding (from `Finding.to_dict`)."""
    if not findings:
        return []
    lines = ["\n## The paper's claims, tested (paired bootstrap 95% CIs over prompts)\n",
             "| claim | comparison | metric | estimate [95% CI] | prompts | verdict |", "|---|---|---|---|---|---|"]
    for f in findings:
        ci = f["ci"]
        points = "points" in f["metric"]
        fmt = (lambda v: f"{100 * v:+.1f}") if points else (lambda v: f"{v:+.1%}")
        lines.append(f"| {f['claim']} | {f['comparison']} | {f['metric']} | {fmt(ci['estimate'])} "
                     f"[{fmt(ci['low'])}, {fmt(ci['high'])}] | {f['prompts']} | {f['verdict']} |")
    return lines


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
    apart (the shards of a merged evaluation, `eval/merge.py`) compare by their own plain decoding."""
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


def _acceptance_columns(record: dict[str, Any], late: range) -> list[float]:
    """Conditional acceptance at position 1 and pooled over `late`, as (accepted, reached) counts.

    Position k (1-based) is reached by a step that accepted >= k-1 drafts and did not stop after
    k-1 (a step that verified only k-1 drafts, `num_drafted`, never tried k), and accepted by one
    that accepted >= k.
    """
    accepted = np.asarray(record["num_accepted"], dtype=np.int64)
    drafted = np.asarray(record.get("num_drafted") or [np.iinfo(np.int64).max] * len(accepted), dtype=np.int64)
    first = [float((accepted >= 1).sum()), float(len(accepted))]
    tried = [((accepted >= k - 1) & (drafted >= k)).sum() for k in late]
    pooled = [float(sum((accepted >= k).sum() for k in late)), float(sum(tried))]
    return first + pooled


def _gap_widening(s: np.ndarray) -> np.ndarray:
    """(late_a - late_b) - (first_a - first_b) from column sums (..., 8) laid out as
    [first_acc_a, first_reached_a, late_acc_a, late_reached_a, first_acc_b, ..., late_reached_b]."""
    first_a, late_a = s[..., 0] / s[..., 1], s[..., 2] / s[..., 3]
    first_b, late_b = s[..., 4] / s[..., 5], s[..., 6] / s[..., 7]
    return (late_a - late_b) - (first_a - first_b)
