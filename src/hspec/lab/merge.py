"""`hspec lab merge`: one evaluation made of several run apart ("shards").

A long comparison (`scripts/compare_long.sh`) trains fourteen drafters for hours each. Its trained
weights are too big to keep in the repository and are lost with the machine, so the comparison is run
shard by shard: a few kinds are trained and at once evaluated, each shard on whatever machine is at
hand, and only the shard's evaluation JSONs are kept. Merging the shards of one evaluation (the files of
one stem) gives the file the comparison would have written in one run, which `hspec lab claims` and
`hspec eval-report` read as they read any `hspec eval` JSON.

What makes shards comparable, checked here:
- the same settings except the methods, their checkpoints and decoding options: target, dtype, K, sampling, tasks,
  items, max_new_tokens, seed, compiling and drafter precision (another dtype, picked by `--dtype auto`
  on another CPU, decodes other text and is refused);
- each drafter label in one shard only, and every record carrying the plain decoding it ran beside
  (`plain_decode_s`, `plain_tokens`, `plain_digest`, which `hspec eval` records), so each drafter's
  speedup is over its own shard's plain decoding (`eval/paired.py: speedup_ratio`) and two drafters are paired
  only on turns where their shards' plain decoding emitted the same tokens (`paired.same_plain`).
Plain decoding's own records ("none") are kept from the first shard (`merge_shards`: the first evaluated);
on how many turns each other shard's plain output differs from them is recorded (`plain_turns_differing`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hspec.eval.runner import summarize, write_report
from hspec.lab.findings import claim_findings
from hspec.provenance import provenance

PLAIN = "none"
PLAIN_FIELDS = ("plain_decode_s", "plain_tokens", "plain_digest")  # what each record must carry
PER_DRAFTER_SETTINGS = ("checkpoints", "drafter_options")  # settings keyed by method label
PER_SHARD_SETTINGS = ("methods", *PER_DRAFTER_SETTINGS)  # settings in which shards may differ


def merge_payloads(shards: Sequence[tuple[str, dict[str, Any]]], command: str) -> dict[str, Any]:
    """The payload of one evaluation from its shards' payloads, each given with its name (its file).

    Raises ValueError naming the shard and what is wrong: settings that differ, a drafter in two
    shards, records without their plain decoding.
    """
    if not shards:
        raise ValueError("no shards to merge")
    first_name, first = shards[0]
    common = _common_settings(first)
    for name, payload in shards[1:]:
        theirs = _common_settings(payload)
        differing = sorted(k for k in set(common) | set(theirs) if common.get(k) != theirs.get(k))
        if differing:
            detail = "; ".join(f"{k}: {common.get(k)!r} in {first_name}, {theirs.get(k)!r}" for k in differing)
            raise ValueError(f"{name} was evaluated with other settings than {first_name} ({detail}); shards of one "
                             "evaluation need the same settings (pin --dtype where CPUs differ)")
    owner: dict[str, str] = {}  # drafter label -> shard that ran it
    plain: dict[tuple[str, str, int], str] = {}  # (task, item, turn) -> the first shard's plain digest
    records: list[dict[str, Any]] = []
    differing_turns: dict[str, int] = {}
    labels_of: dict[str, list[str]] = {}  # shard -> its drafter labels, in run order
    for index, (name, payload) in enumerate(shards):
        for r in payload["records"]:
            missing = [f for f in PLAIN_FIELDS if f not in r]
            if missing:
                raise ValueError(f"{name}: the record of {r['method']} on {r['item']} lacks {', '.join(missing)} "
                                 "(made before `hspec eval` recorded the plain decoding beside each drafter); "
                                 "evaluate that shard again")
        labels_of[name] = _drafter_labels(payload)
        for label in labels_of[name]:
            if label in owner:
                raise ValueError(f"{label} is in two shards, {owner[label]} and {name}; a drafter belongs to one")
            owner[label] = name
        differing_turns[name] = 0
        for r in payload["records"]:
            key = (r["task"], r["item"], r["turn"])
            if r["method"] != PLAIN:
                records.append(r)
            elif index == 0:
                plain[key] = r["plain_digest"]
                records.append(r)
            elif plain.get(key) != r["plain_digest"]:
                differing_turns[name] += 1
    per_drafter = {key: {label: value for _, p in shards
                         for label, value in p["provenance"]["settings"].get(key, {}).items()}
                   for key in PER_DRAFTER_SETTINGS}
    settings = {**common, "methods": ",".join([PLAIN, *owner]), **{key: v for key, v in per_drafter.items() if v}}
    meta = provenance(command, settings)
    meta["shards"] = [{"file": name, "methods": ",".join(labels_of[name]),
                       "plain_turns_differing": differing_turns[name],
                       **{key: p["provenance"].get(key) for key in ("command", "date", "commit", "tree_dirty",
                                                                     "machine")}}
                      for name, p in shards]
    k_setting = common["K"]
    summary = summarize(records, [PLAIN, *owner], k_setting if isinstance(k_setting, int) else k_setting[0],
                        claim_findings)
    return {"provenance": meta, "summary": summary, "records": records}


def merge_shards(shard_dirs: Sequence[Path], out_dir: Path, command: str = "hspec lab merge") -> list[Path]:
    """Merge, stem by stem, the `hspec eval` JSONs of `shard_dirs` into `out_dir` (JSON, markdown and plots
    as `hspec eval` writes them). A stem merges the shards that hold it in the order they were evaluated
    (the dates their files record; where dates tie, the order given), so the first shard evaluated gives
    the plain decoding records and the drafters keep the order they ran in. Returns the merged JSONs' paths."""
    stems: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for directory in shard_dirs:
        if not directory.is_dir():
            raise FileNotFoundError(f"shard directory {directory} does not exist")
        for path in sorted(directory.glob("*.json")):
            payload = _eval_payload(path)
            if payload is not None:
                stems.setdefault(path.stem, []).append((str(path), payload))
    if not stems:
        raise FileNotFoundError(f"no `hspec eval` JSONs in {', '.join(map(str, shard_dirs))}")
    written = []
    for stem, shards in stems.items():
        shards.sort(key=lambda shard: str(shard[1]["provenance"].get("date", "")))
        write_report(merge_payloads(shards, command), out_dir, stem)
        written.append(out_dir / f"{stem}.json")
    return written


def _eval_payload(path: Path) -> dict[str, Any] | None:
    """The payload at `path` when it is an `hspec eval` result, else None (other JSONs a folder holds)."""
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(payload, dict) or not {"provenance", "records"} <= set(payload):
        return None
    return payload


def _drafter_labels(payload: dict[str, Any]) -> list[str]:
    """A shard's drafter labels in the order it ran them (its records' order: the order of `--drafters`)."""
    return [label for label in dict.fromkeys(r["method"] for r in payload["records"]) if label != PLAIN]


def _common_settings(payload: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in payload["provenance"].get("settings", {}).items() if k not in PER_SHARD_SETTINGS}
