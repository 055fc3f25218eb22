"""The scaling curve's report: tau against log2(blocks), with intervals from resampled sequences.

Per point (a finished run) and set (held out, Spec-Bench): tau = tokens per greedy step (accepted + 1, summed
over the set's sequences, over their steps) and the first drafted position's acceptance (steps accepting at
least one draft / steps). The fit is least squares of tau on log2(blocks) over the points, so its slope is
tau gained per doubling of the training budget; the budget where the fitted line reaches a given tau follows
from it. Intervals are percentile bootstrap intervals over sequences, resampled jointly across points: every
point was measured on the same sequences, so a resample keeps each sequence's difficulty common to all
points, as a paired comparison does (`eval/bootstrap.py`).

Legend: P points (runs), N sequences, R resamples, K draft length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hspec.provenance import provenance, provenance_markdown, write_results

SETS = {"held_out": "held out (training-style text)", "spec_bench": "Spec-Bench"}


def histogram_matrix(points: Sequence[Mapping[str, Any]], name: str) -> tuple[list[str], np.ndarray]:
    """(sequence ids, (P, N, K+1) accepted-count histograms) of set `name`, over the sequences every point has."""
    common = sorted(set.intersection(*(set(p["measured"][name]) for p in points)))
    hist = np.array([[p["measured"][name][seq] for seq in common] for p in points], dtype=np.float64)
    return common, hist


def tau_and_first(hist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """tau and first-position acceptance of (..., N, K+1) histograms summed over N: each (...)."""
    K = hist.shape[-1] - 1
    steps = hist.sum(axis=(-2, -1))
    tokens = (hist * np.arange(1, K + 2)).sum(axis=(-2, -1))
    return tokens / steps, 1.0 - hist[..., 0].sum(axis=-1) / steps


def fit_line(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares (intercept, slope) of y (..., P) on x (P,): each (...)."""
    xc = x - x.mean()
    slope = (y * xc).sum(axis=-1) / (xc**2).sum()
    return y.mean(axis=-1) - slope * x.mean(), slope


def blocks_at(tau: float, intercept: np.ndarray, slope: np.ndarray) -> np.ndarray:
    """The budget (blocks) where the line intercept + slope * log2(blocks) reaches `tau`; inf where it never does."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        out = np.exp2((tau - intercept) / slope)
    return np.where(slope > 0, out, np.inf)


def _interval(values: np.ndarray, estimate: float, confidence: float) -> dict[str, float | None]:
    """The estimate and the percentile interval of its resamples `values` (R,); None stands for infinity (a
    budget the line never reaches), which JSON cannot hold. The nearest order statistics, so an infinite
    resample is never interpolated."""
    lo, hi = np.percentile(values, [50 * (1 - confidence), 50 * (1 + confidence)], method="nearest")
    return {key: float(v) if np.isfinite(v) else None for key, v in (("estimate", estimate), ("low", lo), ("high", hi))}


def curve_statistics(points: Sequence[Mapping[str, Any]], name: str, tau_goal: float, resamples: int = 2000,
                     seed: int = 0, confidence: float = 0.95) -> dict[str, Any]:
    """Per point tau and first-position acceptance, and the fit over the points, each with its interval."""
    ids, hist = histogram_matrix(points, name)  # (P, N, K+1)
    if not ids:
        raise ValueError(f"the points share no measured sequence of {name}")
    x = np.log2([p["blocks"] for p in points]).astype(np.float64)
    tau, first = tau_and_first(hist)  # (P,)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(ids), size=(resamples, len(ids)))  # (R, N)
    tau_r, first_r = tau_and_first(hist[:, draws].transpose(1, 0, 2, 3))  # (R, P)
    out: dict[str, Any] = {
        "sequences": len(ids), "steps": [int(s) for s in hist.sum(axis=(1, 2))],
        "tau": [_interval(tau_r[:, i], tau[i], confidence) for i in range(len(points))],
        "first_acceptance": [_interval(first_r[:, i], first[i], confidence) for i in range(len(points))],
    }
    if len(points) >= 2:
        a, b = fit_line(x, tau)
        a_r, b_r = fit_line(x, tau_r)
        goal_r = blocks_at(tau_goal, a_r, b_r)
        out["fit"] = {"intercept": float(a), "slope_per_doubling": _interval(b_r, b, confidence),
                      "first_slope_per_doubling": _interval(fit_line(x, first_r)[1], fit_line(x, first)[1],
                                                            confidence),
                      "tau_goal": tau_goal, "blocks_at_goal": _interval(goal_r, float(blocks_at(tau_goal, a, b)),
                                                                         confidence),
                      "resamples_never_reaching_goal": float(np.mean(np.isinf(goal_r)))}
    return out


def reference_statistics(reference: Mapping[str, Any], points: Sequence[Mapping[str, Any]], name: str,
                         resamples: int = 2000, seed: int = 0, confidence: float = 0.95) -> dict[str, Any]:
    """The reference drafter's tau and first-position acceptance on the curve's sequences of `name`; where the
    reference states its blocks and the curve has 2+ points, what the curve's line predicts there and the
    reference's tau less that prediction (resampled with the same draws as `curve_statistics`)."""
    ids, hist = histogram_matrix(points, name)  # (P, N, K+1)
    ref = np.array([reference["measured"][name][seq] for seq in ids], dtype=np.float64)  # (N, K+1)
    tau, first = tau_and_first(ref[None])
    draws = np.random.default_rng(seed).integers(0, len(ids), size=(resamples, len(ids)))  # (R, N)
    tau_r, first_r = tau_and_first(ref[draws])  # (R,)
    out: dict[str, Any] = {"blocks": reference.get("blocks"), "tau": _interval(tau_r, tau[0], confidence),
                           "first_acceptance": _interval(first_r, first[0], confidence)}
    if reference.get("blocks") and len(points) >= 2:
        x = np.log2([p["blocks"] for p in points]).astype(np.float64)
        at = np.log2(reference["blocks"])
        a, b = fit_line(x, tau_and_first(hist)[0])
        a_r, b_r = fit_line(x, tau_and_first(hist[:, draws].transpose(1, 0, 2, 3))[0])
        out["fit_at_blocks"] = _interval(a_r + b_r * at, a + b * at, confidence)
        out["above_fit"] = _interval(tau_r - (a_r + b_r * at), tau[0] - (a + b * at), confidence)
    return out


def build_report(points: Sequence[Mapping[str, Any]], reference: Mapping[str, Any] | None,
                 tau_goals: Mapping[str, float], seed: int = 0) -> dict[str, Any]:
    """The report's summary: per set the curve's statistics and the reference's on the same sequences."""
    summary: dict[str, Any] = {"points": [{k: p[k] for k in ("blocks", "steps", "run_dir", "train_minutes",
                                                           "final_loss", "precision", "train_sequences")}
                                          for p in points], "sets": {}}
    for name in SETS:
        if not points:
            break
        stats = curve_statistics(points, name, tau_goals[name], seed=seed)
        if reference is not None:
            stats["reference"] = reference_statistics(reference, points, name, seed=seed)
        summary["sets"][name] = stats
    return summary


def _ci(entry: Mapping[str, float], digits: int = 3) -> str:
    return f"{entry['estimate']:.{digits}f} [{entry['low']:.{digits}f}, {entry['high']:.{digits}f}]"


def _blocks(x: float | None) -> str:
    if x is None:
        return "never"
    return f"{x / 1e3:.1f}k" if x < 1e6 else f"{x / 1e6:.2f}M" if x < 1e9 else f"{x:.1e}"


def render_markdown(payload: Mapping[str, Any], image: str | None) -> str:
    summary, settings = payload["summary"], payload["provenance"]["settings"]
    lines = [f"# Scaling curve: {settings['kind']} on {settings['target']}, tau against training blocks", "",
             provenance_markdown(payload["provenance"]), ""]
    if image:
        lines += [f"![tau against blocks]({image})", ""]
    lines += [f"Each row is its own run from scratch of {settings['seqs_per_step']} x {settings['anchors_per_seq']} "
              f"blocks a step, lr {settings['lr']} with its schedule ending at its budget, draft vocabulary "
              f"{settings['draft_vocab']}. tau and first-position acceptance: greedy, K = "
              f"{payload['K']}, in decode order, [95% bootstrap interval over sequences].", ""]
    sets = summary["sets"]
    head = "| blocks | steps | train min | final loss |"
    rule = "|---|---|---|---|"
    for name in sets:
        head += f" {SETS[name]} tau | {SETS[name]} first-position acceptance |"
        rule += "---|---|"
    lines += [head, rule]
    for i, p in enumerate(summary["points"]):
        row = f"| {p['blocks']:,} | {p['steps']:,} | {p['train_minutes']:.1f} | {p['final_loss']:.3f} |"
        for name in sets:
            row += f" {_ci(sets[name]['tau'][i])} | {_ci(sets[name]['first_acceptance'][i])} |"
        lines.append(row)
    if payload.get("reference"):
        blocks = payload["provenance"]["settings"].get("reference_blocks")
        row = (f"| reference `{payload['reference']}` ({f'{blocks:,} blocks, ' if blocks else ''}another, longer "
               f"history) | | | |")
        for name in sets:
            ref = sets[name].get("reference")
            row += f" {_ci(ref['tau'])} | {_ci(ref['first_acceptance'])} |" if ref else " | |"
        lines.append(row)
    lines += ["", "| set | sequences | tau gained per doubling of blocks | first-position acceptance per doubling | "
                  "blocks where the fit reaches the goal | resamples that never reach it |",
              "|---|---|---|---|---|---|"]
    for name, stats in sets.items():
        fit = stats.get("fit")
        if fit is None:
            continue
        goal = fit["blocks_at_goal"]
        lines.append(f"| {SETS[name]} | {stats['sequences']} | {_ci(fit['slope_per_doubling'])} | "
                     f"{_ci(fit['first_slope_per_doubling'])} | tau {fit['tau_goal']}: {_blocks(goal['estimate'])} "
                     f"[{_blocks(goal['low'])}, {_blocks(goal['high'])}] | "
                     f"{fit['resamples_never_reaching_goal']:.0%} |")
    for name, stats in sets.items():
        ref = stats.get("reference") or {}
        if "fit_at_blocks" in ref:
            lines += ["", f"{SETS[name]}: at the reference's {ref['blocks']:,} blocks the line predicts tau "
                          f"{_ci(ref['fit_at_blocks'])}; the reference measures {_ci(ref['tau'])}, "
                          f"{_ci(ref['above_fit'])} above the line."]
    lines += ["", "The fit is least squares of tau on log2(blocks) over the rows; its interval resamples the "
                  "sequences jointly for every row. The budget at the goal extrapolates that line, which holds only "
                  "while the trend does."]
    return "\n".join(lines) + "\n"


def plot_curve(summary: Mapping[str, Any], path: Path, title: str) -> Path:
    """tau against blocks (log x axis), per set with its fit and the reference's tau as a separate marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = np.array([p["blocks"] for p in summary["points"]], dtype=np.float64)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, stats), color in zip(summary["sets"].items(), ("tab:blue", "tab:orange"), strict=False):
        tau = np.array([t["estimate"] for t in stats["tau"]])
        err = np.array([[t["estimate"] - t["low"], t["high"] - t["estimate"]] for t in stats["tau"]]).T
        ax.errorbar(blocks, tau, yerr=err, fmt="o", color=color, capsize=3, label=f"{SETS[name]}")
        fit = stats.get("fit")
        if fit is not None:
            ref_blocks = (stats.get("reference") or {}).get("blocks") or 0
            xs = np.geomspace(blocks.min(), max(blocks.max() * 4, ref_blocks), 50)
            slope = fit["slope_per_doubling"]["estimate"]
            ax.plot(xs, fit["intercept"] + slope * np.log2(xs), "--", color=color,
                    label=f"fit: {slope:+.3f} per doubling")
        ref = stats.get("reference")
        if ref is not None and ref.get("blocks"):
            t = ref["tau"]
            yerr = [[t["estimate"] - t["low"]], [t["high"] - t["estimate"]]]
            ax.errorbar([ref["blocks"]], [t["estimate"]], yerr=yerr, fmt="*", markersize=11, color=color, capsize=3,
                        label=f"{SETS[name]}, reference drafter (another, longer history)")
        elif ref is not None:
            ax.axhline(ref["tau"]["estimate"], color=color, linestyle=":",
                       label=f"{SETS[name]}, reference drafter (another, longer history)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training blocks (anchors), each run from scratch")
    ax.set_ylabel("tau (greedy, decode order)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_curve_report(points: Sequence[Mapping[str, Any]], reference: Mapping[str, Any] | None,
                       settings: Mapping[str, Any], out_dir: Path, stem: str, command: str,
                       tau_goals: Mapping[str, float]) -> tuple[Path, Path]:
    """JSON + markdown + PNG of the finished points under `out_dir`; returns (json, md)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = build_report(points, reference, tau_goals)
    K = next(iter(points))["measured"]["K"] if points else None
    payload = {"provenance": provenance(command, dict(settings)), "K": K, "summary": summary,
               "reference": None if reference is None else reference["drafter"]}
    image = None
    if len(points) >= 1:
        image = plot_curve(summary, out_dir / f"{stem}.png", f"{settings['kind']} on {settings['target']}").name
    return write_results(out_dir, stem, payload, render_markdown(payload, image))
