"""Plots of an evaluation run (matplotlib, PNG): acceptance per position (paper Fig. 4), tau and
speedup per task or category (the shape of the paper's Table 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_eval(summary: dict[str, Any], out_prefix: Path, title: str) -> list[Path]:
    """Write `<prefix>_acceptance.png` and `<prefix>_tau_speedup.png`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = summary["tasks"]
    labels = list(groups["all"].keys())
    drafters = [m for m in labels if m != "none"]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in drafters:
        acc = [float("nan") if a is None else a for a in groups["all"][m]["acceptance_by_position"]]
        tau = groups["all"][m]["mean_accepted_length"]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{m} (tau {tau:.2f})")
    ax.set(xlabel="block position k", ylabel="P(accept k | accepted k-1)", ylim=(0, 1), title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_prefix.with_name(out_prefix.name + "_acceptance.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

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
    fig.tight_layout()
    paths.append(out_prefix.with_name(out_prefix.name + "_tau_speedup.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
