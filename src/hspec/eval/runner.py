"""`hspec eval`: drafters against plain decoding on the task suites, interleaved item by item.

For every item (and every turn of a multi-turn item) the methods run back to back on the same
prompt — plain decoding first — so machine noise hits all of them alike. Greedy outputs must equal
plain decoding's token for token (checked on every item). Per method and task we report MAL tau,
the decode-phase speedup (plain ITL / method ITL), per-position conditional acceptance, and paired
bootstrap 95% CIs of each drafter's relative difference to the best other drafter.

Finished items are kept in `<out>/<stem>.partial.jsonl` as they finish (`hspec.eval.partial`): the same
command run again after a kill resumes with the first unfinished item.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hspec.data.tasks import load_task
from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters.base import Drafter
from hspec.drafters.checkpoint import checkpoint_digest
from hspec.drafters.cost_aware import CostAwareDrafter
from hspec.drafters.plain import PLAIN
from hspec.drafters.step_cost import StepCost
from hspec.eval.bootstrap import paired_bootstrap_relative_diff
from hspec.eval.labels import split_sweep_label, sweep_label
from hspec.eval.paired import paired_records, records_by_prompt, speed_pair, speedup_ratio, tau_ratio
from hspec.eval.partial import ItemLog
from hspec.metrics import acceptance_stats, merge_stats
from hspec.models.loading import Target, load_target
from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.runtime import build_drafter, drafter_precision_of
from hspec.sampling import SamplingParams

WARM_UP_TOKENS = 8  # untimed tokens each method decodes before the timed items
# Claims tested on an evaluation's records at draft length K, each a dict `render_findings` reads: claim,
# comparison, metric, ci (estimate, low, high), prompts, verdict.
FindingsRule = Callable[[Sequence[dict[str, Any]], int], list[dict[str, Any]]]
# Makes a method's drafter: (kind, target, checkpoint path or None, **how) as `hspec.runtime.build_drafter`.
DrafterBuilder = Callable[..., Drafter]


@dataclass(frozen=True)
class MethodSpec:
    kind: str  # drafter kind; "none" is plain decoding
    path: str | None = None  # checkpoint (trained kinds); None = the shipped one

    @property
    def label(self) -> str:
        """The kind, or "<kind>@<run>" for a checkpoint of another name (a run directory's `drafter/`
        is named after its run)."""
        if self.path is None:
            return self.kind
        path = Path(self.path)
        name = path.parent.name if path.name == "drafter" else path.name
        return self.kind if name == self.kind else f"{self.kind}@{name}"


def run_eval(target_name: str, methods: Sequence[MethodSpec], task_names: Sequence[str], size: int | None,
             K: int | Sequence[int], sampling: SamplingParams, max_new_tokens: int, out_dir: Path, stem: str,
             seed: int = 0, command: str = "hspec eval", data_dir: str | Path | None = None,
             dtype: str = "auto", target: Target | None = None, compile_drafters: bool = False,
             drafter_precision: str = "auto", keep_current: bool = False,
             drafter_options: Mapping[str, Mapping[str, Any]] | None = None,
             step_cost: StepCost | None = None, findings: FindingsRule | None = None,
             build: DrafterBuilder = build_drafter, decoder: type[SpeculativeDecoder] = SpeculativeDecoder
             ) -> dict[str, Any]:
    """Evaluate `methods` and plain decoding at each draft length in `K`.

    Every method first decodes WARM_UP_TOKENS untimed (first-call dispatch, and with `compile_drafters`
    the drafters' torch.compile), then the items run interleaved: each turn every method in turn, plain
    decoding first and the methods in the given order on even turns, in the reverse order on odd ones, so
    that whatever one run leaves the CPU for the next (a speculating run can leave it slower:
    results/adaptive_length/README.md) weighs on every method alike. `drafter_precision`: how trained
    drafters store their linear weights (`hspec.runtime.for_inference`). `drafter_options`: per drafter kind,
    decoding options set on its trained config (`hspec.runtime.decoding_options_of`); the settings record them
    per label.

    The tasks are read from `data_dir` (default: $HSPEC_DATA_DIR, else the data shipped in hspec/data).
    `target`: the target `target_name` names, already loaded (then `dtype` is not used); None loads it.

    With several K (the draft-length sensitivity, paper Table 4) each drafter runs once per K on
    every item, labelled "<method> k=<K>"; plain decoding runs once per item.

    `findings`: claims the summary tests on the records (`summarize`).
    `build` makes each method's drafter, called as `hspec.runtime.build_drafter` is (the default; e.g. with
    `random_weights=True` bound, untrained drafters), and `decoder` is the class each method decodes with
    (a subclass may watch or interrupt its `generate` calls).

    The settings record each given checkpoint's digest (`checkpoint_digest`), so a retrained drafter is
    never mixed with items of its earlier weights. `keep_current`: where `<out_dir>/<stem>.json` was made
    with these very settings (the same checkpoints by content), return it instead of decoding again.
    """
    ks = [K] if isinstance(K, int) else list(K)
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"K must be one or more draft lengths >= 1, got {K}")
    specs = [MethodSpec(PLAIN), *[m for m in methods if m.kind != PLAIN]]
    labels = [m.label for m in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"two methods share a label in {labels}; give their checkpoints distinct directory names")
    tasks = [load_task(name, size, data_dir) for name in task_names]  # a missing file fails before loading
    if target is None:
        target = load_target(target_name, dtype=dtype)  # dtype: --dtype (auto, float32, bfloat16)
    settings = {"target": target.name, "dtype": target.model.dtype_name,
                "K": ks[0] if len(ks) == 1 else ks, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "top_k": sampling.top_k, "max_new_tokens": max_new_tokens,
                "tasks": ",".join(task_names), "size_per_task": size, "seed": seed,
                "methods": ",".join(m.label for m in specs), "compile_drafters": compile_drafters,
                "drafter_precision": drafter_precision_of(drafter_precision, target),
                **({} if data_dir is None else {"data_dir": str(data_dir)})}
    # Built first, so a bad checkpoint path gets build_drafter's error; compiling waits for the first call.
    options = {m.label: dict((drafter_options or {}).get(m.kind, {})) for m in specs}
    if any(options.values()):
        settings["drafter_options"] = {label: opts for label, opts in options.items() if opts}
    drafters = {m.label: build(m.kind, target, m.path, compiled=compile_drafters, precision=drafter_precision,
                               options=options[m.label], K=max(ks), step_cost=step_cost)
                for m in specs}
    costs = {label: d.cost.to_dict() for label, d in drafters.items() if isinstance(d, CostAwareDrafter)}
    if costs:  # `:auto` drafters: the step costs their lengths were chosen by (measured here or given)
        settings["step_costs"] = costs
    checkpoints = {m.label: checkpoint_digest(m.path) for m in specs if m.path is not None}
    if checkpoints:
        settings["checkpoints"] = checkpoints
    if keep_current:
        current = current_report(out_dir / f"{stem}.json", settings)
        if current is not None:
            print(f"[eval] {out_dir / stem}.json was made with these settings and checkpoints; kept", flush=True)
            return current
    runs: dict[str, tuple[SpeculativeDecoder, int]] = {}  # label -> (decoder, K)
    for m in specs:
        for k in ([ks[0]] if m.kind == PLAIN else ks):
            label = m.label if (len(ks) == 1 or m.kind == PLAIN) else sweep_label(m.label, k)
            runs[label] = (decoder(target.model, drafters[m.label], k, target.tokenizer.eos_token_ids), k)
    warm_up = target.tokenizer.encode_chat([{"role": "user", "content": tasks[0].items[0].turns[0]}])
    for dec, _ in runs.values():
        dec.generate([warm_up], sampling, WARM_UP_TOKENS, seeds=[seed])
    meta = provenance(command, settings)
    log = ItemLog(out_dir / f"{stem}.partial.jsonl", settings, meta["commit"])  # finished items, kept on disk
    total_turns = sum(len(item.turns) for task in tasks for item in task.items)
    done_turns = sum(len(item.turns) for task in tasks for item in task.items if (task.name, item.id) in log.done)
    bar = tqdm(total=total_turns, initial=done_turns, desc="eval", unit="turn")
    turns_run = 0  # turns decoded by this call: their parity sets the methods' order
    for task in tasks:
        for item in task.items:
            if (task.name, item.id) in log.done:
                continue
            item_records: list[dict[str, Any]] = []
            messages: list[dict[str, str]] = []
            for turn_index, turn in enumerate(item.turns):
                messages.append({"role": "user", "content": turn})
                prompt = target.tokenizer.encode_chat(messages)
                outputs, lookup_steps = {}, {}
                order = list(runs.items()) if turns_run % 2 == 0 else list(runs.items())[::-1]
                turns_run += 1
                for label, (dec, _) in order:
                    looked_up = dec.drafter.lookup_rows
                    outputs[label] = dec.generate([prompt], sampling, max_new_tokens, seeds=[seed])
                    if looked_up is not None:  # KIND+ngram: the steps prompt lookup drafted
                        lookup_steps[label] = dec.drafter.lookup_rows - looked_up  # type: ignore[operator]
                reference = outputs[PLAIN].sequences[0].token_ids
                # Each record keeps the plain decoding it ran beside, so records of evaluations run apart still
                # compare by their own plain timing and are paired only on the same text (`lab/merge.py`).
                plain = {"plain_decode_s": outputs[PLAIN].decode_s, "plain_tokens": len(reference),
                         "plain_digest": tokens_digest(reference)}
                # How busy the CPU was while the turn's methods ran (its 1-minute load average, the eval's own
                # threads included): timings from a shared CPU are not evidence (`lab.claims`, SHARED_LOAD).
                busy = {"load_1min": round(os.getloadavg()[0], 2), "threads": torch.get_num_threads()}
                for label in runs:  # records in the methods' order, whatever order they ran in
                    out = outputs[label]
                    seq = out.sequences[0]
                    if sampling.greedy and seq.token_ids != reference:
                        raise RuntimeError(f"{label} changed the greedy output on {item.id}: lossless bug")
                    item_records.append({"task": task.name, "category": item.category, "item": item.id,
                                         "turn": turn_index, "method": label, "K": runs[label][1],
                                         "tokens": len(seq.token_ids), "decode_s": out.decode_s,
                                         "num_accepted": seq.num_accepted, **busy, **plain,
                                         **({"num_drafted": seq.num_drafted}
                                            if any(n < runs[label][1] for n in seq.num_drafted) else {}),
                                         **({"lookup_steps": lookup_steps[label]}
                                            if label in lookup_steps else {})})
                messages.append({"role": "assistant", "content": target.tokenizer.decode(reference)})
                bar.update(1)
            log.add(task.name, item.id, item_records)
    bar.close()
    if log.commits != [meta["commit"]]:  # items made at other commits (a resumed run): say which
        meta["commits"] = log.commits
    summary = summarize(log.records, list(runs), ks[0], findings)
    payload = {"provenance": meta, "summary": summary, "records": log.records}
    write_report(payload, out_dir, stem)
    log.finish()
    return payload


def tokens_digest(token_ids: Sequence[int]) -> str:
    """16 hex digits of the sha256 of a token sequence: equal outputs, equal digests."""
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:16]


def current_report(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The report at `path` if it was made with `settings` (compared as JSON reads them back), else None."""
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    made_with = payload.get("provenance", {}).get("settings") if isinstance(payload, dict) else None
    return payload if made_with == json.loads(json.dumps(settings)) else None


def summarize(records: list[dict[str, Any]], labels: list[str], K: int,
              findings: FindingsRule | None = None) -> dict[str, Any]:
    """tau, speedup and acceptance per task (and 'all') and method, plus bootstrap CIs.

    A record's own "K" (draft-length sweeps) overrides `K`. CIs compare, among the drafters run at the
    same K, the best by tau with each other one, and a kind's default checkpoint with its others (kind@name).
    `findings`: claims tested on the records of a run at one K over 2+ prompts (the lab's paper claims,
    `hspec.lab.findings.claim_findings`), stored under "findings" and rendered by `render_findings`.
    """
    groups = _groups(records)
    k_of = {label: next((r.get("K", K) for r in records if r["method"] == label), K) for label in labels}
    out: dict[str, Any] = {"tasks": {}, "ci": {}, "K": {label: k_of[label] for label in labels if label != PLAIN}}
    for task, rows in groups.items():
        per_method = {}
        plain = _per_unit(rows, PLAIN)
        for label in labels:
            units = _per_unit(rows, label)
            itl = sum(u["decode_s"] for u in units) / max(sum(u["tokens"] - 1 for u in units), 1)
            if units and all("plain_decode_s" in u for u in units):  # each over its own plain decoding (shards)
                speedup = speedup_ratio(units).value
            else:
                speedup = sum(u["decode_s"] for u in plain) / max(sum(u["tokens"] - 1 for u in plain), 1) / itl
            entry = {"itl_ms": 1000 * itl, "speedup": speedup, "units": len(units)}
            if label != PLAIN:
                stats = merge_stats([acceptance_stats(u["num_accepted"], k_of[label], u.get("num_drafted"))
                                     for u in units])
                entry.update(stats.to_dict())
            if units and all("lookup_steps" in u for u in units):
                entry["lookup_share"] = (sum(u["lookup_steps"] for u in units)
                                         / max(sum(len(u["num_accepted"]) for u in units), 1))
            drafted = [n for u in units for n in u.get("num_drafted") or ()]  # drafts verified per step
            if 0 in drafted:  # a rule that keeps some steps plain (`:auto`, trees): the share of steps that drafted
                entry["drafted_share"] = sum(n > 0 for n in drafted) / len(drafted)
            per_method[label] = entry
        out["tasks"][task] = per_method
    by_prompt = records_by_prompt(records)
    for k in sorted(set(out["K"].values())):
        drafters = [label for label, lk in out["K"].items() if lk == k]
        if len(drafters) < 2 or len(_per_unit(records, drafters[0])) < 2:  # a bootstrap needs 2+ prompts
            continue
        best = max(drafters, key=lambda d: out["tasks"]["all"][d]["mean_accepted_length"])
        pairs = [(best, label) for label in drafters if label != best]
        for label in drafters:  # a kind's default checkpoint against its other checkpoints (kind@name)
            kind = label.split("@", 1)[0]
            if "@" in label and kind in drafters and {(kind, label), (label, kind)}.isdisjoint(pairs):
                pairs.append((kind, label))
        for a, b in pairs:
            units_a, units_b = paired_records(by_prompt, [a, b])
            if len(units_a) < 2:
                continue
            tau = paired_bootstrap_relative_diff(tau_ratio(units_a), tau_ratio(units_b), seed=0)
            speed = paired_bootstrap_relative_diff(*speed_pair(units_a, units_b), seed=0)
            out["ci"][f"{a} vs {b}"] = {"tau_relative_diff": tau.to_dict(), "speedup_relative_diff": speed.to_dict()}
    ks = set(out["K"].values())
    if findings is not None and len(ks) == 1 and len({(r["task"], r["item"], r["turn"]) for r in records}) >= 2:
        out["findings"] = findings(records, ks.pop())
    return out


def _groups(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows per task, per category where a task has several (Spec-Bench's six), and 'all'."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for task in sorted({r["task"] for r in records}):
        rows = [r for r in records if r["task"] == task]
        categories = sorted({r["category"] for r in rows})
        if len(categories) > 1:
            for category in categories:
                groups[f"{task}/{category}"] = [r for r in rows if r["category"] == category]
        groups[task] = rows
    groups["all"] = records
    return groups


def write_report(payload: dict[str, Any], out_dir: Path, stem: str) -> None:
    """JSON + markdown + plots of an evaluation payload."""
    from hspec.eval.plots import plot_ablations, plot_eval, plot_k_sensitivity

    out_dir.mkdir(parents=True, exist_ok=True)
    settings = payload["provenance"]["settings"]
    title = f"{settings['target']}, K={settings['K']}, T={settings['temperature']}"
    pngs = plot_eval(payload["summary"], out_dir / stem, title)
    pngs += plot_ablations(payload["summary"], out_dir / stem, title)
    pngs += plot_k_sensitivity(payload["summary"], out_dir / stem, title)
    write_results(out_dir, stem, payload, render_markdown(payload, [p.name for p in pngs]))


def _per_unit(rows: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["method"] == label]


def render_markdown(payload: dict[str, Any], images: Sequence[str] = ()) -> str:
    summary = payload["summary"]
    labels = list(next(iter(summary["tasks"].values())).keys())
    rerendered = payload["provenance"].get("report_command")
    lines = ["# Speculative decoding evaluation\n", provenance_markdown(payload["provenance"]),
             f"- tables and plots re-rendered from the saved records by `{rerendered}`\n" if rerendered else "",
             *_shard_lines(payload["provenance"].get("shards", [])),
             "\n## MAL tau and decode speedup over plain decoding (same runtime, interleaved)\n",
             "| task | " + " | ".join(f"{m} tau | {m} speedup" for m in labels) + " |",
             "|---|" + "---|---|" * len(labels)]
    for task, per in summary["tasks"].items():
        cells = []
        for m in labels:
            tau = per[m].get("mean_accepted_length")
            tau_text = "1.00" if m == PLAIN else ("-" if tau is None else f"{tau:.2f}")
            cells.append(f"{tau_text} | {per[m]['speedup']:.2f}x")
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    max_k = max(summary.get("K", {}).values(), default=_max_k(payload["provenance"]["settings"]["K"]))
    lines += ["\n## Per-position conditional acceptance (all tasks)\n",
              "| method | " + " | ".join(f"k={k + 1}" for k in range(max_k)) + " |", "|---|" + "---|" * max_k]
    for m in labels:
        if m == PLAIN:
            continue
        acc = summary["tasks"]["all"][m]["acceptance_by_position"]
        acc = acc + [None] * (max_k - len(acc))
        lines.append(f"| {m} | " + " | ".join("-" if a is None else f"{a:.3f}" for a in acc) + " |")
    lines += _k_sensitivity_table(summary)
    lines += _lookup_share_table(summary)
    lines += _drafted_share_table(summary)
    lines += [f"\n![{name}]({name})" for name in images]
    if summary["ci"]:
        lines += ["\n## Paired bootstrap 95% CIs (best drafter by tau vs each other, a kind vs its other checkpoints; "
                  "10,000 resamples)\n",
                  "| comparison | tau: relative diff [CI] | speed: relative diff [CI] |", "|---|---|---|"]
        for name, ci in summary["ci"].items():
            t, s = ci["tau_relative_diff"], ci["speedup_relative_diff"]
            lines.append(f"| {name} | {t['estimate']:+.1%} [{t['low']:+.1%}, {t['high']:+.1%}] | "
                         f"{s['estimate']:+.1%} [{s['low']:+.1%}, {s['high']:+.1%}] |")
    lines += render_findings(summary.get("findings", []))
    return "\n".join(lines) + "\n"


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


def _shard_lines(shards: Sequence[dict[str, Any]]) -> list[str]:
    """For a merged evaluation (`lab/merge.py`): where each shard's drafters were evaluated."""
    if not shards:
        return []
    lines = ["\nMerged from evaluations run apart (each drafter's speedup is over the plain decoding of its own "
             "shard; drafters are paired only on turns where their shards' plain outputs agree):\n",
             "| shard | drafters | commit | date | machine | plain turns differing from the first shard's |",
             "|---|---|---|---|---|---|"]
    for shard in shards:
        lines.append(f"| `{shard['file']}` | {shard['methods']} | {shard['commit']} | {shard['date']} | "
                     f"{shard['machine'].get('platform')} | {shard['plain_turns_differing']} |")
    return lines


def _lookup_share_table(summary: dict[str, Any]) -> list[str]:
    """Per task, the share of steps prompt lookup drafted for each KIND+ngram method (none: no rows)."""
    labels = [m for m in next(iter(summary["tasks"].values())) if "lookup_share" in summary["tasks"]["all"][m]]
    if not labels:
        return []
    lines = ["\n## Steps drafted by prompt lookup (the rest by the trained drafter)\n",
             "| task | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for task, per in summary["tasks"].items():
        lines.append(f"| {task} | " + " | ".join(f"{per[m].get('lookup_share', 0.0):.1%}" for m in labels) + " |")
    return lines


def _drafted_share_table(summary: dict[str, Any]) -> list[str]:
    """Per task, the share of steps that verified drafts for each method that kept some steps plain (`:auto`:
    tau is over the drafting steps alone; the rest were plain decode steps)."""
    tasks = summary["tasks"]
    labels = [m for m in next(iter(tasks.values())) if any("drafted_share" in per.get(m, {}) for per in tasks.values())]
    if not labels:
        return []
    lines = ["\n## Steps that drafted (tau above is over these; the rest were plain decode steps)\n",
             "| task | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for task, per in tasks.items():
        lines.append(f"| {task} | " + " | ".join(f"{per[m].get('drafted_share', 1.0):.1%}" if m in per else "-"
                                                 for m in labels) + " |")
    return lines


def _max_k(setting: int | list[int]) -> int:
    return setting if isinstance(setting, int) else max(setting)


def _k_sensitivity_table(summary: dict[str, Any]) -> list[str]:
    """Rows per drafter, columns per K: tau / speedup over all tasks (only for draft-length sweeps)."""
    ks = sorted(set(summary.get("K", {}).values()))
    if len(ks) < 2:
        return []
    methods = list(dict.fromkeys(split_sweep_label(label)[0] for label in summary["K"]))
    lines = ["\n## Draft-length sensitivity (all tasks): tau / speedup per inference-time K\n",
             "| method | " + " | ".join(f"K={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    overall = summary["tasks"]["all"]
    for m in methods:
        cells = []
        for k in ks:
            entry = overall.get(sweep_label(m, k))
            cells.append("-" if entry is None else f"{entry['mean_accepted_length']:.2f} / {entry['speedup']:.2f}x")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines
