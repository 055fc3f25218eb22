"""`hspec train-report` and `hspec validate`: markdown summaries (and the loss-curve plot) of training
runs and of saved drafters' validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.training.history import HISTORY_FILE, read_records


def read_history(run_dir: Path) -> dict[str, Any]:
    """Config, step logs and validations of a run directory's history.jsonl."""
    config: dict[str, Any] = {}
    steps, validations = [], []
    for record in read_records(run_dir / HISTORY_FILE):
        event = record.pop("event")
        if event == "config":
            config, steps, validations = record, [], []  # a restarted-from-scratch run starts over
        elif event == "step":
            steps.append(record)
        elif event == "validation":
            validations.append(record)
        elif event == "override":  # a resume with --override: the new settings apply from here on
            config = {**config, **{k: new for k, (_, new) in record["changed"].items() if k in config}}
    return {"config": config, "steps": steps, "validations": validations}


def steps_run(run: dict[str, Any]) -> int:
    """How many optimizer steps a read history (`read_history`) ran, by its last step log or validation."""
    return max([s["step"] + 1 for s in run["steps"][-1:]] + [v["step"] for v in run["validations"][-1:]] + [0])


def training_minutes(run: dict[str, Any]) -> float:
    """Training time of a read history in minutes, estimated as the mean logged step time x steps run (the
    history logs every `log_every`-th step; validations, checkpoints and a resumed run's pauses are left out)."""
    durations = [s["seconds"] for s in run["steps"]]
    return sum(durations) / max(len(durations), 1) * steps_run(run) / 60


def _steps_before(run: dict[str, Any], runs: dict[str, dict[str, Any]]) -> int:
    """Steps of the shown run whose `drafter/` this run started from (`--init-from`), else 0."""
    init_from = run["config"].get("init_from")
    if not init_from or Path(init_from).name != "drafter" or Path(init_from).parent.name not in runs:
        return 0
    parent = runs[Path(init_from).parent.name]
    return int(parent["config"].get("steps", 0)) + _steps_before(parent, runs)


def write_training_report(run_dirs: list[Path], out_md: Path, title: str, extra: dict[str, Any] | None = None) -> Path:
    """Plot the loss curves (PNG next to `out_md`) and tabulate the runs' final validation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {d.name: read_history(d) for d in run_dirs}
    offsets = {name: _steps_before(run, runs) for name, run in runs.items()}
    fig, (ax_loss, ax_tau, ax_acc) = plt.subplots(1, 3, figsize=(16, 4))
    for name, run in runs.items():
        xs = [s["step"] + offsets[name] for s in run["steps"]]
        ax_loss.plot(xs, [s["loss"] for s in run["steps"]], label=name)
        if run["validations"]:
            line, = ax_tau.plot([v["step"] + offsets[name] for v in run["validations"]],
                                [v["mean_accepted_length"] for v in run["validations"]], marker=".", label=name)
            in_order = [v for v in run["validations"] if "decode_order" in v]
            if in_order:
                ax_tau.plot([v["step"] + offsets[name] for v in in_order],
                            [v["decode_order"]["mean_accepted_length"] for v in in_order], marker=".",
                            linestyle="--", color=line.get_color(), label=f"{name}, in decode order")
            last = run["validations"][-1]
            acc = [a if a is not None else float("nan") for a in last["acceptance_by_position"]]
            label = f"{name} (tau {last['mean_accepted_length']:.2f})"
            ax_acc.plot(range(1, len(acc) + 1), acc, marker="o", label=label)
    ax_loss.set(xlabel="optimizer step (a run started from another shown here continues its axis)",
                ylabel="loss (0.1 CE + 0.9 TV, weighted)", title="training loss")
    ax_acc.set(xlabel="block position k", ylabel="P(accept k | accepted k-1)", title="validation acceptance (greedy)",
               ylim=(0, 1))
    ax_tau.set(xlabel="optimizer step", ylabel="validation tau (greedy, teacher-forced; dashed: in decode order)",
               title="validation MAL during training")
    for ax in (ax_loss, ax_tau, ax_acc):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    png = out_md.with_suffix(".png")
    out_md.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)

    recipe = {k: v for k, v in next(iter(runs.values()))["config"].items()
              if k in ("target", "steps", "lr", "weight_decay", "grad_clip", "warmup_fraction", "seqs_per_step",
                       "anchors_per_seq", "seed", "loss", "world_size", "draft_vocab_size",
                       "draft_vocab_coverage")}
    meta = provenance(f"hspec train-report {' '.join(str(d) for d in run_dirs)}", {**recipe, **(extra or {})})
    lines = [f"# {title}\n", provenance_markdown(meta), f"\n![loss curves]({png.name})\n",
             "| run | train seqs | train tokens | val seqs | steps run / scheduled | wall (min) | trainable params "
             "| final loss | val tau | val tau in decode order | val acceptance by position |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        c, steps, vals = run["config"], run["steps"], run["validations"]
        final = vals[-1] if vals else {}
        acc = ", ".join("-" if a is None else f"{a:.2f}" for a in final.get("acceptance_by_position", []))
        tau = final.get("mean_accepted_length")
        in_order = final.get("decode_order", {}).get("mean_accepted_length")
        lines.append(f"| {name} | {c.get('train_sequences')} | {c.get('train_tokens', '-')} | "
                     f"{c.get('val_sequences')} | {steps_run(run)} / {c.get('steps')} | "
                     f"{training_minutes(run):.1f} | {c.get('trainable_params', 0):,} | "
                     f"{steps[-1]['loss'] if steps else float('nan'):.3f} | "
                     f"{'-' if tau is None else f'{tau:.2f}'} | {'-' if in_order is None else f'{in_order:.2f}'} | "
                     f"{acc} |")
    for name, run in runs.items():
        if run["config"].get("init_from"):
            lines.append(f"\n{name} starts from the drafter `{run['config']['init_from']}` (its weights and draft "
                         f"vocabulary; the schedule starts over: lr {run['config'].get('lr')}, "
                         f"{run['config'].get('steps')} steps).")
    lines.append("\nWall time is estimated from the logged steps' durations (mean logged step time x steps).")
    lines.append("\nval tau averages every drafted block alike, at anchors drawn uniformly from the held-out "
                 "responses; val tau in decode order follows the anchors greedy decoding itself visits (each step "
                 "starts after the previous step's accepted tokens), so it weights blocks as `hspec generate` does "
                 "and is the one to compare with measured MAL. It is lower because a well-drafted stretch takes "
                 "fewer steps. \"-\": the run was made before this validation existed.")
    out_md.write_text("\n".join(lines) + "\n")
    return out_md


def write_validation_report(rows: list[dict[str, Any]], command: str, settings: dict[str, Any], out_dir: Path,
                            stem: str) -> tuple[Path, Path]:
    """`<stem>.json` and `<stem>.md`: one row per drafter with its "anchors" and "decode_order" stats."""
    meta = provenance(command, settings)
    lines = ["# Drafter validation on held-out training sequences\n", provenance_markdown(meta),
             "\nGreedy, teacher-forced, the held-out split of `hspec train` (1 in 20 ids). tau = mean accepted "
             "length; \"anchors\" weights 32 uniformly drawn blocks per sequence alike (as `hspec train` logs), "
             "\"in decode order\" follows the anchors greedy decoding itself visits (what `hspec generate` would "
             "measure on these prompts).\n",
             "| drafter | kind | tau (anchors) | tau (in decode order) | steps in decode order | "
             "acceptance by position (in decode order) |", "|---|---|---|---|---|---|"]
    for row in rows:
        acc = ", ".join("-" if a is None else f"{a:.2f}" for a in row["decode_order"]["acceptance_by_position"])
        lines.append(f"| `{row['drafter']}` | {row['kind']} | {row['anchors']['mean_accepted_length']:.3f} | "
                     f"{row['decode_order']['mean_accepted_length']:.3f} | {row['decode_order']['num_steps']} | "
                     f"{acc} |")
    return write_results(out_dir, stem, {"provenance": meta, "drafters": rows}, "\n".join(lines) + "\n")
