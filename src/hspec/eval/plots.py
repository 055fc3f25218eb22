"""Plots of an evaluation run (matplotlib, PNG): acceptance per position (paper Fig. 4), tau and
speedup per task or category (the shape of the paper's Table 2), the ablations (Fig. 7) and the
draft-length sensitivity (Table 4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hspec.drafters import PLAIN
from hspec.eval.labels import split_sweep_label


def plot_eval(summary: dict[str, Any], out_prefix: Path, title: str) -> list[Path]:
    """Write `<prefix>_acceptance.png` and `<prefix>_tau_speedup.png`; returns their paths."""
    plt = _pyplot()

    groups = summary["tasks"]
    labels = list(groups["all"].keys())
    drafters = [m for m in labels if m != PLAIN]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in drafters:
        acc = [float("nan") if a is None else a for a in groups["all"][m]["acceptance_by_position"]]
        tau = groups["all"][m]["mean_accepted_length"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{m} (tau {tau:.2f})")
    ax.set(xlabel="block position k", ylabel="P(accept k | accepted k-1)", ylim=(0, 1), title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_prefix, "acceptance"))

    names = [g for g in groups if g != "all"] + ["all"]
    width = 0.8 / max(len(labels), 1)
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(12, 4))
    for j, m in enumerate(labels):
        xs = [i + j * width for i in range(len(names))]
        ax_tau.bar(xs, [groups[g][m].get("mean_accepted_length") or 1.0 for g in names], width, label=m)
        ax_speed.bar(xs, [groups[g][m]["speedup"] for g in names], width, label=m)
    for ax, ylabel in ((ax_tau, "MAL tau"), (ax_speed, "decode speedup vs plain")):
        ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(names))], names, rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    ax_speed.axhline(1.0, color="black", lw=0.8)
    fig.suptitle(title)
    paths.append(_save(fig, out_prefix, "tau_speedup"))
    return paths


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out_prefix: Path, suffix: str) -> Path:
    """Lay out, write `<prefix>_<suffix>.png`, close; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = out_prefix.with_name(f"{out_prefix.name}_{suffix}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


ABLATION_GROUPS = {
    "(a) target-context source": ("hspec", "hspec-lasttoken-only", "hspec-kvreuse-only"),
    "(b) drafter architecture (no Markov head)": ("mamba-only", "attention-only", "hspec-nomarkov"),
}


def _kind_of(label: str) -> str:
    """'hspec@run k=5' -> 'hspec'."""
    return split_sweep_label(label)[0].split("@")[0]


def plot_ablations(summary: dict[str, Any], out_prefix: Path, title: str) -> list[Path]:
    """The paper's Fig. 7: tau and speedup (all tasks) of the ablation variants beside full H-Spec.

    Draws one panel pair per group with at least two of its kinds present (at the run's largest K);
    writes `<prefix>_ablations.png`, or nothing when no group qualifies.
    """
    overall = summary["tasks"]["all"]
    k_of = summary.get("K", {})
    top_k = max(k_of.values(), default=None)
    by_kind = {_kind_of(label): label for label in overall if label != PLAIN and k_of.get(label) == top_k}
    groups = {name: [k for k in kinds if k in by_kind] for name, kinds in ABLATION_GROUPS.items()}
    groups = {name: kinds for name, kinds in groups.items() if len(kinds) >= 2}
    if not groups:
        return []
    plt = _pyplot()

    fig, axes = plt.subplots(len(groups), 2, figsize=(10, 3.6 * len(groups)), squeeze=False)
    for row, (name, kinds) in enumerate(groups.items()):
        for col, (metric, ylabel) in enumerate((("mean_accepted_length", "MAL tau"), ("speedup", "speedup"))):
            ax = axes[row][col]
            values = [overall[by_kind[k]][metric] for k in kinds]
            bars = ax.bar(kinds, values, color=[f"C{i}" for i in range(len(kinds))])
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
            ax.set(ylabel=ylabel, title=f"{name}: {ylabel}")
            ax.tick_params(axis="x", labelrotation=15)
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Ablations (all tasks), {title}")
    return [_save(fig, out_prefix, "ablations")]


def plot_k_sensitivity(summary: dict[str, Any], out_prefix: Path, title: str) -> list[Path]:
    """The paper's Table 4 as a plot: tau and speedup against the inference-time draft length K.

    Only for runs with several K; writes `<prefix>_k_sensitivity.png`.
    """
    k_of = summary.get("K", {})
    if len(set(k_of.values())) < 2:
        return []
    plt = _pyplot()

    overall = summary["tasks"]["all"]
    methods: dict[str, list[tuple[int, str]]] = {}
    for label, k in k_of.items():
        methods.setdefault(split_sweep_label(label)[0], []).append((k, label))
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    for name, points in methods.items():
        points.sort()
        ks = [k for k, _ in points]
        ax_tau.plot(ks, [overall[label]["mean_accepted_length"] for _, label in points], marker="o", label=name)
        ax_speed.plot(ks, [overall[label]["speedup"] for _, label in points], marker="o", label=name)
    for ax, ylabel in ((ax_tau, "MAL tau"), (ax_speed, "decode speedup vs plain")):
        ax.set(xlabel="draft length K", ylabel=ylabel)
        ax.set_xticks(sorted(set(k_of.values())))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_speed.axhline(1.0, color="black", lw=0.8)
    fig.suptitle(f"Draft-length sensitivity, {title}")
    return [_save(fig, out_prefix, "k_sensitivity")]
