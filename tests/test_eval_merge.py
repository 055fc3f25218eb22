"""`hspec lab merge`: shards of one evaluation, run apart, merged into the file one run would have written."""

from __future__ import annotations

import json

import pytest

from eval_helpers import shard_payload
from hspec import cli
from hspec.lab.claims import GREEDY_K7, SPEEDUP, TAU, check_claims
from hspec.lab.merge import merge_payloads, merge_shards


def test_each_drafter_keeps_its_speedup_over_its_own_shards_plain_decoding():
    # dflash's shard ran on a machine twice as slow: its ITL is higher, its speedup over its own plain the same
    fast = shard_payload("hspec", 2.0, [3, 4], speedup=2.0)
    slow = shard_payload("dflash", 4.0, [1, 2], speedup=2.0)
    fast["provenance"]["settings"]["drafter_options"] = {"hspec": {"node_budget": 5}}  # one shard's, as checkpoints
    merged = merge_payloads([("fast.json", fast), ("slow.json", slow)], "hspec eval-merge (test)")
    overall = merged["summary"]["tasks"]["all"]
    assert overall["hspec"]["speedup"] == pytest.approx(2.0) and overall["dflash"]["speedup"] == pytest.approx(2.0)
    assert overall["dflash"]["itl_ms"] > overall["hspec"]["itl_ms"]
    settings = merged["provenance"]["settings"]
    assert settings["methods"] == "none,hspec,dflash"
    assert settings["checkpoints"] == {"hspec": "digest-of-hspec", "dflash": "digest-of-dflash"}
    assert settings["drafter_options"] == {"hspec": {"node_budget": 5}}
    assert [r["method"] for r in merged["records"]].count("none") == 6  # the first shard's plain decoding
    assert [s["methods"] for s in merged["provenance"]["shards"]] == ["hspec", "dflash"]
    table2 = next(r for r in check_claims({GREEDY_K7: merged}, num_resamples=500) if r.claim.name == "table2")
    speed = next(c for c in table2.comparisons if c.behind == "dflash" and c.metric == SPEEDUP)
    assert speed.ci.estimate == pytest.approx(0.0, abs=1e-9)  # ITL alone would have said +100%
    tau = next(c for c in table2.comparisons if c.behind == "dflash" and c.metric == TAU)
    assert tau.ci.low > 0 and tau.items == 6


def test_turns_whose_plain_outputs_parted_between_shards_are_counted_and_not_paired():
    first = shard_payload("hspec", 2.0, [3, 4], speedup=2.0)
    other = shard_payload("dflash", 2.0, [1, 2], speedup=1.5, **{"2": "q", "4": "q"})  # another CPU's plain text there
    merged = merge_payloads([("a.json", first), ("b.json", other)], "test")
    assert [s["plain_turns_differing"] for s in merged["provenance"]["shards"]] == [0, 2]
    table2 = next(r for r in check_claims({GREEDY_K7: merged}, num_resamples=500) if r.claim.name == "table2")
    assert {c.items for c in table2.comparisons if c.behind == "dflash"} == {4}
    assert "dflash vs hspec" not in merged["summary"]["ci"]
    assert merged["summary"]["ci"]["hspec vs dflash"]["speedup_relative_diff"]["estimate"] == pytest.approx(
        2.0 / 1.5 - 1)


def test_shards_that_cannot_be_one_evaluation_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="dtype: 'bfloat16' in a.json, 'float32'.*pin --dtype"):
        merge_payloads([("a.json", shard_payload("hspec", 2.0, [3], 2.0)),
                        ("b.json", shard_payload("dflash", 2.0, [3], 2.0, dtype="float32"))], "test")
    with pytest.raises(ValueError, match="hspec is in two shards, a.json and b.json"):
        merge_payloads([("a.json", shard_payload("hspec", 2.0, [3], 2.0)),
                        ("b.json", shard_payload("hspec", 2.0, [3], 2.0))], "test")
    old = shard_payload("hspec", 2.0, [3], 2.0)
    for r in old["records"]:
        del r["plain_decode_s"], r["plain_tokens"], r["plain_digest"]
    with pytest.raises(ValueError, match="old.json: the record of none on spec_bench/0 lacks plain_decode_s"):
        merge_payloads([("old.json", old)], "test")


def test_the_command_merges_each_stem_of_the_shard_folders_and_claims_read_the_result(tmp_path, capsys):
    for name, shard in (("h", shard_payload("hspec", 2.0, [3, 4], 2.0)),
                        ("d", shard_payload("dflash", 3.0, [1, 2], 1.5))):
        (tmp_path / "shards" / name).mkdir(parents=True)
        (tmp_path / "shards" / name / f"{GREEDY_K7}.json").write_text(json.dumps(shard))
        (tmp_path / "shards" / name / "not_an_eval.json").write_text(json.dumps({"rows": []}))
    out = tmp_path / "merged"
    assert cli.main(["lab", "merge", str(tmp_path / "shards" / "h"), str(tmp_path / "shards" / "d"),
                     "--out", str(out)]) == 0
    merged = json.loads((out / f"{GREEDY_K7}.json").read_text())
    assert merged["provenance"]["command"].startswith("hspec lab merge ")
    assert {r["method"] for r in merged["records"]} == {"none", "hspec", "dflash"}
    text = (out / f"{GREEDY_K7}.md").read_text()
    assert "Merged from evaluations run apart" in text and "host-of-hspec" in text and "host-of-dflash" in text
    assert not (out / "not_an_eval.json").exists()
    assert cli.main(["lab", "claims", str(out)]) == 0
    with pytest.raises(FileNotFoundError, match="does not exist"):
        merge_shards([tmp_path / "nowhere"], out)


def test_drafters_keep_the_order_their_shards_ran_them_in():
    shard = shard_payload("zeta", 2.0, [3], 2.0)  # "zeta" then "alpha" each turn, as `--drafters zeta,alpha` runs
    shard["records"] = [row for r in shard["records"] for row in
                        ([r, {**r, "method": "alpha"}] if r["method"] == "zeta" else [r])]
    merged = merge_payloads([("a.json", shard), ("b.json", shard_payload("beta", 2.0, [3], 2.0))], "test")
    assert merged["provenance"]["settings"]["methods"] == "none,zeta,alpha,beta"
    assert list(merged["summary"]["tasks"]["all"]) == ["none", "zeta", "alpha", "beta"]
    assert merged["provenance"]["shards"][0]["methods"] == "zeta,alpha"


def test_shard_folders_merge_in_the_order_they_were_evaluated_whatever_their_names(tmp_path):
    """The later shard sorts first by name; the earlier one still gives plain decoding and comes first."""
    for name, drafter, date in (("a-later", "dflash", "2026-12-05T01:00:00+00:00"),
                                ("z-earlier", "hspec", "2026-12-04T22:00:00+00:00")):
        payload = shard_payload(drafter, 2.0, [3], 2.0)
        payload["provenance"]["date"] = date
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{GREEDY_K7}.json").write_text(json.dumps(payload))
    (path,) = merge_shards(sorted(tmp_path.iterdir()), tmp_path / "merged")
    merged = json.loads(path.read_text())
    assert merged["provenance"]["settings"]["methods"] == "none,hspec,dflash"
    assert [s["file"] for s in merged["provenance"]["shards"]] == [str(tmp_path / "z-earlier" / f"{GREEDY_K7}.json"),
                                                                   str(tmp_path / "a-later" / f"{GREEDY_K7}.json")]
