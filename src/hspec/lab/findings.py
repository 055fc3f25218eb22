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
`dflash-kvreuse`), which is how `scripts/compare_smollm2.sh` labels them. `hspec eval` adds these findings to
its summary (`claim_findings`, handed to `eval.runner.summarize`), which renders them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hspec.eval.bootstrap import BootstrapCI, paired_bootstrap, paired_bootstrap_relative_diff
from hspec.eval.paired import paired_records, records_by_prompt, speed_pair, tau_ratio

SUBJECT = "hspec"  # the method the findings are about, compared with each of BASELINES
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
    if SUBJECT in present:
        for baseline in (b for b in BASELINES if b in present):
            ours, theirs = paired_records(per_method, [SUBJECT, baseline])
            tau = paired_bootstrap_relative_diff(tau_ratio(ours), tau_ratio(theirs), seed=seed)
            speed = paired_bootstrap_relative_diff(*speed_pair(ours, theirs), seed=seed)
            findings.append(Finding("H-Spec leads", f"hspec vs {baseline}", "tau, relative difference", tau,
                                    len(ours), +1))
            findings.append(Finding("H-Spec leads", f"hspec vs {baseline}",
                                    "decode speed (hspec speedup / baseline speedup - 1)", speed, len(ours), +1))
        for ablation in (a for a in SINGLE_SOURCE_ABLATIONS if a in present):
            ours, theirs = paired_records(per_method, [SUBJECT, ablation])
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


def claim_findings(records: Sequence[dict[str, Any]], K: int) -> list[dict[str, Any]]:
    """`evaluate_claims` as the summary of `hspec eval` stores it (`eval.runner.summarize`'s `findings`)."""
    return [f.to_dict() for f in evaluate_claims(records, K)]


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
