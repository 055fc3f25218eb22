"""`hspec lab claims`: the H-Spec paper's claims, each tested on the evaluation JSONs of one results folder,
and after them what the later parallel drafters' own sources report of their gain over DFlash or EAGLE-3.

A folder written by `scripts/compare_long.sh` (or `scripts/compare_smollm2.sh`) holds up to four
`hspec eval` files, named by `EVAL_FILES`. Each claim of `CLAIMS` names the files it is tested on and
its comparisons: pairs (ahead, behind) of drafter kinds where the paper puts `ahead` in front, and the
metric on which it does. For every pair, every file and every draft length K in the file, the paired
bootstrap (`eval/bootstrap.py`) gives a 95% CI of the difference, oriented so the paper predicts > 0:

- tau: tau(ahead) / tau(behind) - 1, tau a ratio of sums (tokens emitted by drafted steps / steps);
- speedup: speedup(ahead) / speedup(behind) - 1, each over the plain decoding its records ran beside
  (= ITL(behind) / ITL(ahead) - 1 when both ran beside the same one: plain decoding's ITL cancels);
- late acceptance: conditional acceptance of `behind` subtracted from that of `ahead`, pooled over
  block positions FIRST_LATE_POSITION..K (in points of probability; per position as a detail).

The unit resampled is the item: the turns of a multi-turn item share a conversation, so they move
together. Only items both drafters ran, on the same turns after the same plain outputs, are paired (a
folder merged from shards run on other CPUs, `lab/merge.py`, may hold items whose plain decoding parted).

A comparison is `reproduced` when its CI lies above 0, `contradicted` when it lies below 0, else
`unresolved`. A claim is `contradicted` when any of its comparisons is, `reproduced` when all are and
every pair it names was compared (`reproduced in part` when some pair was in no file: a kind not yet
evaluated), `unresolved` otherwise, and `skipped` when none could run. Whatever could not run (a file missing from
the folder, a kind missing from a run, too few items) is listed with its reason. Kinds are matched by
their eval label, which is the kind itself when a checkpoint lives in `<runs>/<kind>/drafter` and
"<kind>@<run>" when it lives in another run's directory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hspec.drafters import PLAIN
from hspec.eval.bootstrap import BootstrapCI, RatioOfSums, paired_bootstrap, paired_bootstrap_relative_diff
from hspec.eval.labels import split_sweep_label
from hspec.eval.paired import same_plain, speed_pair, tau_ratio
from hspec.metrics import acceptance_stats
from hspec.provenance import provenance, provenance_markdown, write_results

# The stems `scripts/compare_long.sh` gives its evaluations.
GREEDY_K7 = "eval_spec_bench_k7_greedy"  # Spec-Bench subset, K = 7, greedy
SAMPLED_K7 = "eval_spec_bench_k7_t1"  # the same at temperature 1.0
K_SWEEP = "eval_spec_bench_k_sweep_greedy"  # K = 3, 5, 7, greedy
TASKS_K7 = "eval_tasks_k7_greedy"  # MT-Bench, HumanEval, GSM8K, K = 7, greedy
EVAL_FILES = (GREEDY_K7, SAMPLED_K7, K_SWEEP, TASKS_K7)

PARALLEL_BASELINES = ("dspark", "dflash", "peagle")  # the parallel drafters of the paper's Table 2
# 1-based block position from which acceptance counts as "later": the paper's Fig. 4 finds the gap of
# direct KV reuse small at its (0-based) indices 0 and 1 and widening from index 2 on.
FIRST_LATE_POSITION = 3
TAU, SPEEDUP, LATE_ACCEPTANCE = "tau", "speedup", "late acceptance"
# Load above the eval's own threads beyond which its timings are not used (`shared_cpu`): a quiet machine
# reads about its thread count; one more busy process adds about 1.
SHARED_LOAD = 0.5
VERDICTS = ("reproduced", "contradicted", "unresolved")  # of a comparison; a claim also "reproduced in part", "skipped"
STEM = "claims"  # the files written: claims.json, claims.md
CONFIDENCE = 0.95  # nominal coverage of every CI


@dataclass(frozen=True)
class Claim:
    """One claim of the paper: on which eval files, for which drafter pairs and metrics it is tested."""

    name: str  # short id, e.g. "table2"
    source: str  # where the paper makes it, e.g. "Table 2"
    statement: str  # the claim in words
    files: tuple[str, ...]  # stems of the eval JSONs it is tested on (of EVAL_FILES)
    pairs: tuple[tuple[str, str], ...]  # (kind the paper puts ahead, kind it puts behind)
    metrics: tuple[str, ...]  # of TAU, SPEEDUP, LATE_ACCEPTANCE
    sampled: bool = False  # True: only runs at temperature > 0 count


def _lead(*baselines: str) -> tuple[tuple[str, str], ...]:
    return tuple(("hspec", b) for b in baselines)


CLAIMS = (
    Claim("table2", "Table 2", "H-Spec leads the parallel drafters on tau and speedup (K = 7)",
          (GREEDY_K7, TASKS_K7), _lead(*PARALLEL_BASELINES), (TAU, SPEEDUP)),
    Claim("table3", "Table 3", "H-Spec's tau lead holds at temperature 1.0 (K = 7)",
          (SAMPLED_K7,), _lead(*PARALLEL_BASELINES), (TAU,), sampled=True),
    Claim("table4", "Table 4", "H-Spec leads on tau and speedup at every draft length K = 3, 5, 7",
          (K_SWEEP,), _lead(*PARALLEL_BASELINES), (TAU, SPEEDUP)),
    Claim("fig4", "Fig. 4", "direct target-KV reuse loses conditional acceptance at later block positions",
          (GREEDY_K7, TASKS_K7), (("dflash", "dflash-kvreuse"), ("hspec", "hspec-kvreuse-only")),
          (LATE_ACCEPTANCE,)),
    Claim("fig7a", "Fig. 7a", "both target-context sources are needed: H-Spec beats each single-source ablation",
          (GREEDY_K7, TASKS_K7), _lead("hspec-lasttoken-only", "hspec-kvreuse-only"), (TAU,)),
    Claim("fig7b", "Fig. 7b", "the hybrid backbone beats Mamba-only and attention-only (all without the Markov head)",
          (GREEDY_K7, TASKS_K7), (("hspec-nomarkov", "mamba-only"), ("hspec-nomarkov", "attention-only")), (TAU,)),
    Claim("markov", "§3.4, App. B.4", "the Markov head adds to the hybrid backbone: H-Spec beats hspec-nomarkov",
          (GREEDY_K7, TASKS_K7), _lead("hspec-nomarkov"), (TAU,)),
    # The later drafters' own reports (docs/drafters.md says where each comes from), on the same files.
    Claim("dflash2", "DFlash-2 blog", "the dynamic convolutions and the path selector raise tau over DFlash "
          "(~+21%) for ~1% more drafting time", (GREEDY_K7, TASKS_K7), (("dflash2", "dflash"),), (TAU, SPEEDUP)),
    # The same claim with hspec's variant: DFlash-2 trained with the selector's loss kept off the backbone, the
    # change scripts/dflash2_diagnostic.sh found to lift it above DFlash in validation (docs/drafters.md); its
    # label is hspec eval's for a dflash2 checkpoint in the run directory dflash2-selector-detached.
    Claim("dflash2-detached", "DFlash-2 blog (hspec's variant)", "the same, with the selector's loss kept off "
          "the backbone in training", (GREEDY_K7, TASKS_K7), (("dflash2@dflash2-selector-detached", "dflash"),),
          (TAU, SPEEDUP)),
    Claim("dels", "DeLS-Spec abstract", "the local sequential head raises the frozen DFlash drafter's acceptance",
          (GREEDY_K7, TASKS_K7), (("dels", "dflash"),), (TAU, SPEEDUP)),
    Claim("dfly", "DFly abstract", "per-layer fusion and the previous-token correction raise tau (~+30%) and "
          "throughput over DFlash", (GREEDY_K7, TASKS_K7), (("dfly", "dflash"),), (TAU, SPEEDUP)),
    Claim("specblock", "SpecBlock abstract", "tree drafting with the layer-wise shift decodes faster than "
          "EAGLE-3 (+8-13%; here P-Eagle, the EAGLE-3-input drafter)", (GREEDY_K7, TASKS_K7),
          (("specblock", "peagle"),), (SPEEDUP,)),
)


def verdict_of(ci: BootstrapCI) -> str:
    """`reproduced` (CI above 0, the paper's direction), `contradicted` (below 0) or `unresolved`."""
    return "reproduced" if ci.low > 0 else "contradicted" if ci.high < 0 else "unresolved"


@dataclass(frozen=True)
class PositionGap:
    """Acceptance of `ahead` minus `behind` at one block position (a detail of a late-acceptance test)."""

    position: int  # 1-based block position
    ci: BootstrapCI
    items: int  # paired items in which both drafters tried this position

    def to_dict(self) -> dict[str, Any]:
        return {"position": self.position, "ci": self.ci.to_dict(), "items": self.items}


@dataclass(frozen=True)
class Comparison:
    """One bootstrap test of a claim: `ahead` against `behind` on one metric, in one file, at one K."""

    claim: str
    file: str  # eval stem
    K: int
    ahead: str
    behind: str
    metric: str
    ci: BootstrapCI  # of the difference, oriented so the paper predicts > 0
    items: int  # paired items resampled
    by_position: tuple[PositionGap, ...] = ()  # late acceptance only: positions FIRST_LATE_POSITION..K

    @property
    def verdict(self) -> str:
        return verdict_of(self.ci)

    def to_dict(self) -> dict[str, Any]:
        return {"claim": self.claim, "file": self.file, "K": self.K, "ahead": self.ahead, "behind": self.behind,
                "metric": self.metric, "ci": self.ci.to_dict(), "items": self.items, "verdict": self.verdict,
                **({"by_position": [g.to_dict() for g in self.by_position]} if self.by_position else {})}


@dataclass(frozen=True)
class ClaimResult:
    claim: Claim
    comparisons: tuple[Comparison, ...]
    skipped: tuple[str, ...]  # what could not be tested, each with its reason

    @property
    def verdict(self) -> str:
        verdicts = {c.verdict for c in self.comparisons}
        if not verdicts:
            return "skipped"
        if "contradicted" in verdicts:
            return "contradicted"
        if verdicts != {"reproduced"}:
            return "unresolved"
        return "reproduced in part" if self.untested_pairs else "reproduced"

    @property
    def untested_pairs(self) -> tuple[tuple[str, str], ...]:
        """The claim's pairs compared in no file (a kind not evaluated yet, as in a comparison still being
        sharded): a claim is `reproduced` only when every pair it names was."""
        tested = {(c.ahead, c.behind) for c in self.comparisons}
        return tuple(pair for pair in self.claim.pairs if pair not in tested)

    def to_dict(self) -> dict[str, Any]:
        c = self.claim
        return {"name": c.name, "source": c.source, "statement": c.statement, "verdict": self.verdict,
                "comparisons": [x.to_dict() for x in self.comparisons], "skipped": list(self.skipped)}


# A run: (kind, K) -> (task, item, turn) -> record
Runs = dict[tuple[str, int], dict[tuple[str, str, int], dict[str, Any]]]


@dataclass
class _Context:
    """One claim being tested: the bootstrap's settings in, its comparisons and skip reasons out."""

    claim: Claim
    seed: int
    num_resamples: int
    comparisons: list[Comparison] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def load_evals(folder: Path) -> dict[str, dict[str, Any]]:
    """The eval payloads of `EVAL_FILES` present in `folder`, by stem.

    Raises FileNotFoundError when the folder is missing or holds none of them, ValueError when one
    is not an `hspec eval` JSON.
    """
    if not folder.is_dir():
        raise FileNotFoundError(f"results folder {folder} does not exist")
    evals = {}
    for stem in EVAL_FILES:
        path = folder / f"{stem}.json"
        if not path.exists():
            continue
        try:
            payload = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(payload, dict) or not {"provenance", "records"} <= set(payload):
            raise ValueError(f"{path} is not an `hspec eval` result: it needs 'provenance' and 'records'")
        evals[stem] = payload
    if not evals:
        raise FileNotFoundError(f"{folder} holds none of the evaluation files the claims read: "
                                f"{', '.join(f'{s}.json' for s in EVAL_FILES)}")
    return evals


def check_claims(evals: Mapping[str, Mapping[str, Any]], claims: Sequence[Claim] = CLAIMS, seed: int = 0,
                 num_resamples: int = 10_000) -> list[ClaimResult]:
    """Every claim tested on the eval payloads (by stem) it reads; see the module docstring."""
    runs = {stem: _runs(payload) for stem, payload in evals.items()}
    results = []
    for claim in claims:
        ctx = _Context(claim, seed, num_resamples)
        for stem in claim.files:
            if stem not in evals:
                ctx.skipped.append(f"{stem}.json: not in the folder")
                continue
            temperature = evals[stem]["provenance"].get("settings", {}).get("temperature", 0.0)
            if claim.sampled and not temperature > 0:
                ctx.skipped.append(f"{stem}.json: temperature {temperature}, but this claim needs a sampled run "
                                   "(temperature > 0)")
                continue
            _compare_in_file(ctx, stem, runs[stem])
        results.append(ClaimResult(claim, tuple(ctx.comparisons), tuple(ctx.skipped)))
    return results


def write_claims(folder: Path, out_dir: Path | None = None, command: str = "hspec lab claims", seed: int = 0,
                 num_resamples: int = 10_000) -> tuple[Path, Path]:
    """Test every claim on the eval JSONs of `folder`; write claims.json + claims.md to `out_dir`
    (default: `folder`). Returns the two paths."""
    evals = load_evals(folder)
    results = check_claims(evals, seed=seed, num_resamples=num_resamples)
    settings = {"folder": str(folder), "seed": seed, "resamples": num_resamples, "confidence": CONFIDENCE,
                "first_late_position": FIRST_LATE_POSITION}
    inputs = {stem: {key: payload["provenance"].get(key) for key in ("command", "date", "commit", "tree_dirty")}
              | {"settings": payload["provenance"].get("settings", {})} for stem, payload in evals.items()}
    payload = {"provenance": provenance(command, settings), "inputs": inputs,
               "claims": [r.to_dict() for r in results]}
    return write_results(out_dir or folder, STEM, payload, render_claims(payload))


def _runs(payload: Mapping[str, Any]) -> Runs:
    """Records by (kind, K) and prompt. Draft-length sweeps label a run "<kind> k=<K>"; plain decoding
    ("none") is left out."""
    setting = payload["provenance"].get("settings", {}).get("K")
    runs: Runs = {}
    for r in payload["records"]:
        if r["method"] == PLAIN:
            continue
        kind, _ = split_sweep_label(r["method"])
        K = r.get("K", setting)
        if not isinstance(K, int):
            raise ValueError(f"the record of {r['method']} on {r['item']} names no K, and the run's K setting "
                             f"{setting!r} is not one draft length")
        runs.setdefault((kind, K), {})[(r["task"], r["item"], r["turn"])] = r
    return runs


def _compare_in_file(ctx: _Context, stem: str, runs: Runs) -> None:
    for K in sorted({k for _, k in runs}):
        present = sorted(kind for kind, k in runs if k == K)
        for ahead, behind in ctx.claim.pairs:
            where = f"{stem}.json K={K}: {ahead} vs {behind}"
            missing = [kind for kind in (ahead, behind) if (kind, K) not in runs]
            if missing:
                ctx.skipped.append(f"{where}: {' and '.join(missing)} not in the run (it ran {', '.join(present)})")
                continue
            units_a, units_b, item_index = _paired(runs[(ahead, K)], runs[(behind, K)])
            for metric in ctx.claim.metrics:
                result = _METRICS[metric](ctx, units_a, units_b, item_index, K)
                if isinstance(result, str):
                    ctx.skipped.append(f"{where}: {metric}: {result}")
                    continue
                ci, items, by_position = result
                ctx.comparisons.append(Comparison(ctx.claim.name, stem, K, ahead, behind, metric, ci, items,
                                                  by_position))


def _paired(a: Mapping[tuple, dict], b: Mapping[tuple, dict]) -> tuple[list[dict], list[dict], np.ndarray]:
    """The two runs' records on the items both ran on the same turns after the same plain outputs (`same_plain`:
    shards merged from other CPUs may have parted), in one order, and each record's item index (R,) into
    those items."""
    def turns(run: Mapping[tuple, dict]) -> dict[tuple[str, str], set[int]]:
        out: dict[tuple[str, str], set[int]] = {}
        for task, item, turn in run:
            out.setdefault((task, item), set()).add(turn)
        return out

    turns_a, turns_b = turns(a), turns(b)
    items = sorted(i for i in turns_a if turns_b.get(i) == turns_a[i]
                   and all(same_plain(a[(*i, turn)], b[(*i, turn)]) for turn in turns_a[i]))
    keys = [(*item, turn) for item in items for turn in sorted(turns_a[item])]
    index = {item: n for n, item in enumerate(items)}
    return [a[k] for k in keys], [b[k] for k in keys], np.array([index[k[:2]] for k in keys], dtype=np.int64)


def _per_item(ratio: RatioOfSums, item_index: np.ndarray) -> RatioOfSums:
    """Per-record numerators and denominators summed over each item's records: (R,) -> (items,)."""
    n = int(item_index.max()) + 1 if item_index.size else 0
    return RatioOfSums(np.bincount(item_index, ratio.numerator, n), np.bincount(item_index, ratio.denominator, n))


_Result = tuple[BootstrapCI, int, tuple[PositionGap, ...]] | str  # (ci, items, detail) or why it could not run


def _tau(ctx: _Context, units_a: list[dict], units_b: list[dict], item_index: np.ndarray, K: int) -> _Result:
    """tau(a) / tau(b) - 1 over paired items."""
    return _relative(ctx, _per_item(tau_ratio(units_a), item_index), _per_item(tau_ratio(units_b), item_index))


def _speedup(ctx: _Context, units_a: list[dict], units_b: list[dict], item_index: np.ndarray, K: int) -> _Result:
    """speedup(a) / speedup(b) - 1 over paired items (`speed_pair`; ITL(b) / ITL(a) - 1 beside one plain
    decoding): how much faster a decodes than b; not run on timings taken on a shared CPU (`shared_cpu`)."""
    shared = shared_cpu(units_a + units_b)
    if shared is not None:
        return shared
    ahead, behind = speed_pair(units_a, units_b)
    return _relative(ctx, _per_item(ahead, item_index), _per_item(behind, item_index))


def shared_cpu(records: Sequence[dict]) -> str | None:
    """Why these records' timings are not evidence, or None: the eval runner records the CPU's 1-minute
    load average after each turn, its own threads included; when the median over the records exceeds the
    eval's threads by more than SHARED_LOAD, other work took CPU time from the methods it timed (plain
    decoding took ~320 ms a token instead of ~20 in such a run), and a speed comparison would measure that
    work. Records from before the runner kept the load (no `load_1min`) are taken as they are."""
    loads = [r["load_1min"] - r["threads"] for r in records if "load_1min" in r]
    if not loads or float(np.median(loads)) <= SHARED_LOAD:
        return None
    return (f"timed on a shared CPU: the median 1-minute load exceeded the eval's threads by "
            f"{float(np.median(loads)):.1f} (more than {SHARED_LOAD}), so its speeds are not evidence")


def _relative(ctx: _Context, ahead: np.ndarray, behind: np.ndarray) -> _Result:
    """The paired bootstrap of ahead / behind - 1, or why it cannot run."""
    if len(ahead) < 2:
        return f"{len(ahead)} paired item(s), a bootstrap needs 2"
    return paired_bootstrap_relative_diff(ahead, behind, seed=ctx.seed, num_resamples=ctx.num_resamples,
                                          confidence=CONFIDENCE), len(ahead), ()


def _late_acceptance(ctx: _Context, units_a: list[dict], units_b: list[dict], item_index: np.ndarray,
                     K: int) -> _Result:
    if K < FIRST_LATE_POSITION:
        return f"K={K} has no block position >= {FIRST_LATE_POSITION}"
    late = slice(FIRST_LATE_POSITION - 1, K)
    counts = np.concatenate([_item_position_counts(units_a, item_index, K),
                             _item_position_counts(units_b, item_index, K)], axis=2)  # (items, K, 4)
    pooled = _acceptance_gap(ctx, counts[:, late].sum(axis=1))
    if pooled is None:
        return f"fewer than 2 items in which both tried a position >= {FIRST_LATE_POSITION}"
    gaps = []
    for position in range(FIRST_LATE_POSITION, K + 1):
        gap = _acceptance_gap(ctx, counts[:, position - 1])
        if gap is not None:
            gaps.append(PositionGap(position, *gap))
    return pooled[0], pooled[1], tuple(gaps)


def _acceptance_gap(ctx: _Context, columns: np.ndarray) -> tuple[BootstrapCI, int] | None:
    """CI of accepted_a / tried_a - accepted_b / tried_b from per-item columns (items, 4) laid out as
    [accepted_a, tried_a, accepted_b, tried_b], over the items where both tried; None under 2 such items."""
    columns = columns[(columns[:, 1] > 0) & (columns[:, 3] > 0)]
    if len(columns) < 2:
        return None
    ci = paired_bootstrap(columns, lambda s: s[..., 0] / s[..., 1] - s[..., 2] / s[..., 3], seed=ctx.seed,
                          num_resamples=ctx.num_resamples, confidence=CONFIDENCE)
    return ci, len(columns)


def _item_position_counts(units: list[dict], item_index: np.ndarray, K: int) -> np.ndarray:
    """(items, K, 2): per item and 1-based block position k, [steps that accepted draft k, steps that
    tried it], summed over the item's turns; accepted / tried is `AcceptanceStats.acceptance_by_position`."""
    per_record = np.zeros((len(units), K, 2))
    for n, u in enumerate(units):
        stats = acceptance_stats(np.asarray(u["num_accepted"], dtype=np.int64), K, u.get("num_drafted"))
        reached = np.cumsum(stats.accepted_count_histogram[::-1])[::-1]  # (K+1,) steps with >= k accepted
        per_record[n, :, 0] = reached[1:]
        per_record[n, :, 1] = reached[:-1] - np.asarray(stats.stopped_histogram[:-1])
    out = np.zeros((int(item_index.max()) + 1 if item_index.size else 0, K, 2))
    np.add.at(out, item_index, per_record)
    return out


_METRICS: dict[str, Callable[[_Context, list[dict], list[dict], np.ndarray, int], _Result]] = {
    TAU: _tau, SPEEDUP: _speedup, LATE_ACCEPTANCE: _late_acceptance}


def render_claims(payload: Mapping[str, Any]) -> str:
    """claims.md from the claims.json payload."""
    claims = payload["claims"]
    level = f"{payload['provenance']['settings']['confidence']:.0%}"
    lines = ["# The H-Spec paper's claims and the later drafters' own, tested\n",
             provenance_markdown(payload["provenance"]),
             "\nEvaluations read (each with its own provenance in claims.json):\n"]
    for stem, meta in payload["inputs"].items():
        s = meta["settings"]
        lines.append(f"- `{stem}.json`: commit {meta['commit']}, {meta['date']}, K={s.get('K')}, "
                     f"T={s.get('temperature')}, tasks {s.get('tasks')}, {s.get('size_per_task')} items per task")
    lines += [f"\nA comparison is *reproduced* when the paired bootstrap {level} CI of its difference (resampling "
              "items) lies on the paper's side of 0, *contradicted* when it lies on the other side, else "
              "*unresolved*. A claim is contradicted when any comparison is, reproduced when all are.\n",
              "## Verdicts\n", "| claim | paper | statement | verdict | reproduced / contradicted / unresolved |",
              "|---|---|---|---|---|"]
    for c in claims:
        counts = " / ".join(str(sum(x["verdict"] == v for x in c["comparisons"])) for v in VERDICTS)
        lines.append(f"| {c['name']} | {c['source']} | {c['statement']} | **{c['verdict']}** | {counts} |")
    lines += ["\n## Comparisons\n", "tau and speedup: relative difference of ahead over behind; late acceptance: "
              f"conditional acceptance of ahead minus behind at positions {FIRST_LATE_POSITION}..K, in points.\n",
              f"| claim | file | K | ahead vs behind | metric | estimate [{level} CI] | items | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    for c in claims:
        for x in c["comparisons"]:
            lines.append(f"| {c['name']} | {x['file']} | {x['K']} | {x['ahead']} vs {x['behind']} | {x['metric']} | "
                         f"{_ci_text(x['ci'], x['metric'])} | {x['items']} | {x['verdict']} |")
    detail = [(c, x) for c in claims for x in c["comparisons"] if x.get("by_position")]
    if detail:
        lines += ["\n## Acceptance gap by block position (detail of the late-acceptance comparisons)\n",
                  f"| file | ahead vs behind | position | ahead - behind, points [{level} CI] | items |",
                  "|---|---|---|---|---|"]
        for _, x in detail:
            for g in x["by_position"]:
                lines.append(f"| {x['file']} | {x['ahead']} vs {x['behind']} | {g['position']} | "
                             f"{_ci_text(g['ci'], LATE_ACCEPTANCE)} | {g['items']} |")
    skipped = [(c["name"], reason) for c in claims for reason in c["skipped"]]
    if skipped:
        lines += ["\n## Not tested\n"] + [f"- {name}: {reason}" for name, reason in skipped]
    return "\n".join(lines) + "\n"


def _ci_text(ci: Mapping[str, float], metric: str) -> str:
    if metric == LATE_ACCEPTANCE:
        return f"{100 * ci['estimate']:+.1f} [{100 * ci['low']:+.1f}, {100 * ci['high']:+.1f}]"
    return f"{ci['estimate']:+.1%} [{ci['low']:+.1%}, {ci['high']:+.1%}]"
