"""The evaluation summary on hand-built records: tau, speedup, per-category groups, CIs, plots."""

from __future__ import annotations

from functools import partial

import pytest

from hspec.eval.runner import render_markdown, summarize


def _records():
    rows = []
    for i, category in enumerate(["qa", "qa", "translation", "translation"]):
        common = {"task": "spec_bench", "category": category, "item": f"x{i}", "turn": 0, "tokens": 11}
        rows.append({**common, "method": "none", "decode_s": 1.0, "num_accepted": []})
        rows.append({**common, "method": "a", "decode_s": 0.5, "num_accepted": [3, 1, 0]})  # tau 7/3
        rows.append({**common, "method": "b", "decode_s": 0.8, "num_accepted": [0, 1, 0, 1]})  # tau 6/4
    return rows


def test_tau_speedup_and_groups():
    summary = summarize(_records(), ["none", "a", "b"], K=3)
    assert set(summary["tasks"]) == {"spec_bench/qa", "spec_bench/translation", "spec_bench", "all"}
    a, b = summary["tasks"]["all"]["a"], summary["tasks"]["all"]["b"]
    assert a["mean_accepted_length"] == pytest.approx(7 / 3) and b["mean_accepted_length"] == pytest.approx(1.5)
    assert a["speedup"] == pytest.approx(2.0) and b["speedup"] == pytest.approx(1.25)
    assert a["acceptance_by_position"][0] == pytest.approx(2 / 3)
    ci = summary["ci"]["a vs b"]["tau_relative_diff"]
    assert ci["estimate"] == pytest.approx((7 / 3) / 1.5 - 1) and ci["low"] <= ci["estimate"] <= ci["high"]


def test_a_method_that_keeps_some_steps_plain_reports_the_share_of_steps_that_drafted():
    rows = _records()
    for row in rows:
        if row["method"] == "a":  # `:auto`-like: the second of its three steps drafted nothing
            row["num_accepted"], row["num_drafted"] = [3, 0, 0], [3, 0, 1]
        if row["method"] == "b":  # verified drafts on every step
            row["num_drafted"] = [3, 3, 3, 3]
    summary = summarize(rows, ["none", "a", "b"], K=3)
    a = summary["tasks"]["all"]["a"]
    assert a["drafted_share"] == pytest.approx(2 / 3)
    assert a["mean_accepted_length"] == pytest.approx((4 + 1) / 2)  # over the two steps that drafted
    assert all("drafted_share" not in summary["tasks"]["all"][m] for m in ("b", "none"))
    payload = {"provenance": {"command": "test", "date": "d", "commit": "c",
                              "machine": {"cuda": None, "processor": "x", "cpu_count": 2, "torch_threads": 1,
                                          "platform": "p", "torch": "t"},
                              "settings": {"K": 3, "target": "tiny", "temperature": 0.0}},
               "summary": summary, "records": rows}
    text = render_markdown(payload, [])
    assert "## Steps that drafted" in text and "| all | 66.7% |" in text


def test_markdown_and_plots(tmp_path):
    from hspec.eval.plots import plot_eval

    summary = summarize(_records(), ["none", "a", "b"], K=3)
    payload = {"provenance": {"command": "test", "date": "d", "commit": "c",
                              "machine": {"cuda": None, "processor": "x", "cpu_count": 2, "torch_threads": 1,
                                          "platform": "p", "torch": "t"},
                              "settings": {"K": 3, "target": "tiny", "temperature": 0.0}},
               "summary": summary}
    text = render_markdown(payload)
    assert "| spec_bench/qa |" in text and "a vs b" in text
    paths = plot_eval(summary, tmp_path / "run", "test")
    assert all(p.exists() and p.stat().st_size > 1000 for p in paths)


def _sweep_records():
    """Two drafters at K = 3 and K = 5 on two items, plain decoding once."""
    rows = []
    for i in range(2):
        common = {"task": "spec_bench", "category": "qa", "item": f"x{i}", "turn": 0, "tokens": 11}
        rows.append({**common, "method": "none", "K": 3, "decode_s": 1.0, "num_accepted": []})
        rows.append({**common, "method": "hspec k=3", "K": 3, "decode_s": 0.5, "num_accepted": [3, 3, 0]})
        rows.append({**common, "method": "dspark k=3", "K": 3, "decode_s": 0.6, "num_accepted": [1, 3, 0]})
        rows.append({**common, "method": "hspec k=5", "K": 5, "decode_s": 0.4, "num_accepted": [5, 2]})
        rows.append({**common, "method": "dspark k=5", "K": 5, "decode_s": 0.7, "num_accepted": [4, 0]})
    return rows


def test_draft_length_sweep_uses_each_runs_K_and_compares_within_K(tmp_path):
    from hspec.eval.plots import plot_k_sensitivity

    labels = ["none", "hspec k=3", "dspark k=3", "hspec k=5", "dspark k=5"]
    summary = summarize(_sweep_records(), labels, K=3)
    overall = summary["tasks"]["all"]
    assert summary["K"] == {"hspec k=3": 3, "dspark k=3": 3, "hspec k=5": 5, "dspark k=5": 5}
    assert len(overall["hspec k=5"]["acceptance_by_position"]) == 5
    assert overall["hspec k=5"]["mean_accepted_length"] == pytest.approx(9 / 2)  # (6 + 3) / 2 steps
    assert set(summary["ci"]) == {"hspec k=3 vs dspark k=3", "hspec k=5 vs dspark k=5"}
    payload = {"provenance": {"command": "test", "date": "d", "commit": "c",
                              "machine": {"cuda": None, "processor": "x", "cpu_count": 2, "torch_threads": 1,
                                          "platform": "p", "torch": "t"},
                              "settings": {"K": [3, 5], "target": "tiny", "temperature": 0.0}},
               "summary": summary}
    text = render_markdown(payload)
    assert "| hspec | 3.00 / 2.00x | 4.50 / 2.50x |" in text and "k=5 |" in text
    paths = plot_k_sensitivity(summary, tmp_path / "run", "test")
    assert len(paths) == 1 and paths[0].stat().st_size > 1000


def test_ablation_plot_needs_two_kinds_of_a_group(tmp_path):
    from hspec.eval.plots import plot_ablations

    rows = []
    for method in ("none", "hspec", "hspec-kvreuse-only", "ngram"):
        rows.append({"task": "t", "category": "c", "item": "x", "turn": 0, "tokens": 9, "method": method, "K": 3,
                     "decode_s": 1.0, "num_accepted": [] if method == "none" else [1, 2]})
    summary = summarize(rows, ["none", "hspec", "hspec-kvreuse-only", "ngram"], K=3)
    paths = plot_ablations(summary, tmp_path / "run", "test")
    assert len(paths) == 1 and paths[0].stat().st_size > 1000
    lone = summarize([r for r in rows if r["method"] != "hspec-kvreuse-only"], ["none", "hspec", "ngram"], K=3)
    assert plot_ablations(lone, tmp_path / "lone", "test") == []


def _tiny_eval_setup(tmp_path, tiny_target, monkeypatch):
    """The tiny target with a chat stub tokenizer, for run_eval, and 3 two-turn mt_bench items."""
    import dataclasses
    import json

    from hspec.data.tasks import DATA_DIR_ENV

    class ChatStub:
        def __init__(self, inner):
            self.inner, self.eos_token_ids = inner, inner.eos_token_ids

        def encode_chat(self, messages):
            return self.inner.encode_prompt(" ".join(m["content"][:40] for m in messages))

        def decode(self, ids):
            return self.inner.decode(ids)

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"id": f"mt_bench/{i}", "category": "writing", "turns": [f"Write {i} lines.", "Now shorter."]}
            for i in range(3)]
    (data / "mt_bench.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setenv(DATA_DIR_ENV, str(data))
    return dataclasses.replace(tiny_target, tokenizer=ChatStub(tiny_target.tokenizer))


def _counting_decoder(calls: list, interrupt_at: int | None = None):
    """A SpeculativeDecoder that records each prompt it decodes in `calls` and raises KeyboardInterrupt on
    call number `interrupt_at` (a kill mid-run)."""
    from hspec.decoding.generate import SpeculativeDecoder

    class Counting(SpeculativeDecoder):
        def generate(self, prompts, *args, **kwargs):
            calls.append(prompts[0])
            if len(calls) == interrupt_at:
                raise KeyboardInterrupt
            return super().generate(prompts, *args, **kwargs)

    return Counting


def test_run_eval_sweeps_K_on_a_tiny_target(tmp_path, tiny_target, monkeypatch):
    """Plain decoding once per turn, n-gram once per K; greedy outputs are checked equal inside."""
    from hspec.eval.runner import MethodSpec, run_eval
    from hspec.sampling import SamplingParams

    target = _tiny_eval_setup(tmp_path, tiny_target, monkeypatch)
    payload = run_eval("tiny", [MethodSpec("ngram")], ["mt_bench"], 2, [2, 4], SamplingParams(), 12, tmp_path,
                       "sweep", target=target)
    methods = [r["method"] for r in payload["records"]]
    assert methods.count("none") == 4 and methods.count("ngram k=2") == 4 and methods.count("ngram k=4") == 4
    for plain in (r for r in payload["records"] if r["method"] == "none"):  # each record keeps its plain decoding
        turn = [r for r in payload["records"] if (r["item"], r["turn"]) == (plain["item"], plain["turn"])]
        assert {(r["plain_decode_s"], r["plain_tokens"], r["plain_digest"]) for r in turn} == {
            (plain["decode_s"], plain["tokens"], plain["plain_digest"])}
    assert payload["summary"]["K"] == {"ngram k=2": 2, "ngram k=4": 4}
    import torch

    assert all(r["load_1min"] >= 0 and r["threads"] == torch.get_num_threads() for r in payload["records"])
    assert (tmp_path / "sweep_k_sensitivity.png").exists() and (tmp_path / "sweep.md").exists()


def test_run_eval_reports_the_share_of_steps_prompt_lookup_drafted(tmp_path, tiny_target, monkeypatch):
    from hspec.eval import runner
    from hspec.runtime import build_drafter
    from hspec.sampling import SamplingParams

    target = _tiny_eval_setup(tmp_path, tiny_target, monkeypatch)
    payload = runner.run_eval("tiny", [runner.MethodSpec("hspec+ngram")], ["mt_bench"], 2, 3, SamplingParams(), 24,
                              tmp_path, "lookup", target=target, build=partial(build_drafter, random_weights=True))
    rows = [r for r in payload["records"] if r["method"] == "hspec+ngram"]
    assert len(rows) == 4 and all(0 <= r["lookup_steps"] <= len(r["num_accepted"]) for r in rows)
    assert sum(r["lookup_steps"] for r in rows) > 0  # the tiny target repeats itself within 24 tokens
    share = payload["summary"]["tasks"]["all"]["hspec+ngram"]["lookup_share"]
    assert share == sum(r["lookup_steps"] for r in rows) / sum(len(r["num_accepted"]) for r in rows)
    assert "lookup_share" not in payload["summary"]["tasks"]["all"]["none"]
    assert f"| all | {share:.1%} |" in (tmp_path / "lookup.md").read_text()


def test_method_labels_name_the_run_and_must_be_distinct():
    from hspec.eval.runner import MethodSpec, run_eval

    assert MethodSpec("hspec").label == "hspec"
    assert MethodSpec("hspec", "runs/compare/hspec/drafter").label == "hspec"
    assert MethodSpec("hspec", "runs/train/hspec_v2/drafter").label == "hspec@hspec_v2"
    assert MethodSpec("dspark", "ckpt/dspark-small").label == "dspark@dspark-small"
    with pytest.raises(ValueError, match="share a label"):
        run_eval("unused", [MethodSpec("hspec"), MethodSpec("hspec", "x/hspec")], ["mt_bench"], 1, 3, None, 4,
                 None, "x")


def test_a_kind_is_compared_with_its_other_checkpoints():
    rows = _records()
    for row in [r for r in rows if r["method"] == "b"]:
        rows.append({**row, "method": "a@old"})  # the old checkpoint of kind a drafts like b
    summary = summarize(rows, ["none", "a", "b", "a@old"], K=3)
    assert set(summary["ci"]) == {"a vs b", "a vs a@old"}  # a is the best: no duplicate entry
    ci = summary["ci"]["a vs a@old"]["tau_relative_diff"]
    assert ci["estimate"] == pytest.approx((7 / 3) / 1.5 - 1)
    speed = summary["ci"]["a vs a@old"]["speedup_relative_diff"]
    assert speed["estimate"] == pytest.approx(0.8 / 0.5 - 1)
    worse_default = summarize([{**r, "method": {"a": "a@new", "a@old": "a"}.get(r["method"], r["method"])}
                               for r in rows], ["none", "a", "b", "a@new"], K=3)
    assert "a@new vs a" in worse_default["ci"] and "a vs a@new" not in worse_default["ci"]  # once, best first


def test_run_eval_takes_every_trained_kind_greedy_and_sampled(tmp_path, tiny_target, monkeypatch):
    """The long comparison evaluates every kind after hours of training: each one must get through
    run_eval's greedy run (outputs checked equal to plain inside) and its temperature-1 run."""
    from hspec.drafters import DRAFTERS
    from hspec.eval import runner
    from hspec.runtime import build_drafter
    from hspec.sampling import SamplingParams

    target = _tiny_eval_setup(tmp_path, tiny_target, monkeypatch)
    kinds = [k for k in DRAFTERS.names() if DRAFTERS.get(k).needs_target_model]
    assert {"hspec", "dflash2", "dels", "dfly", "specblock"} <= set(kinds)
    methods = [runner.MethodSpec(k) for k in kinds]
    for name, sampling in (("greedy", SamplingParams()), ("t1", SamplingParams(temperature=1.0))):
        payload = runner.run_eval("tiny", methods, ["mt_bench"], 1, 3, sampling, 8, tmp_path, name, target=target,
                                  build=partial(build_drafter, random_weights=True))
        done = {r["method"] for r in payload["records"]}
        assert done == {"none", *kinds}, name


def test_a_killed_eval_resumes_with_its_first_unfinished_item(tmp_path, tiny_target, monkeypatch):
    """Finished items survive a crash in `<stem>.partial.jsonl`; the rerun decodes only the others, reports
    what an uninterrupted run reports, deletes the log, and refuses a log made with other settings."""
    from hspec.eval.runner import MethodSpec, run_eval
    from hspec.sampling import SamplingParams

    target = _tiny_eval_setup(tmp_path, tiny_target, monkeypatch)
    calls = []
    args = ("tiny", [MethodSpec("ngram")], ["mt_bench"], 3, 3, SamplingParams(), 12, tmp_path)
    with pytest.raises(KeyboardInterrupt):  # 2 methods x 2 turns per item, + warm-up: killed in the second item
        run_eval(*args, "resumed", target=target, decoder=_counting_decoder(calls, interrupt_at=2 + 4 + 1))
    log = tmp_path / "resumed.partial.jsonl"
    assert len(log.read_text().splitlines()) == 2  # the settings, then the one finished item
    with pytest.raises(ValueError, match="settings that differ: max_new_tokens"):
        run_eval(*args[:6], 16, tmp_path, "resumed", target=target)
    calls.clear()
    resumed = run_eval(*args, "resumed", target=target, decoder=_counting_decoder(calls))
    assert len(calls) == 2 + 2 * 4  # the warm-ups and items 1 and 2 only
    assert not log.exists() and "commits" not in resumed["provenance"]
    whole = run_eval(*args, "whole", target=target)
    timing = {"decode_s", "plain_decode_s", "load_1min"}  # what a rerun measures anew
    strip = [{k: v for k, v in r.items() if k not in timing} for r in resumed["records"]]
    assert strip == [{k: v for k, v in r.items() if k not in timing} for r in whole["records"]]
    tau = [p["summary"]["tasks"]["all"]["ngram"]["mean_accepted_length"] for p in (resumed, whole)]
    assert tau[0] == tau[1] > 1


def test_an_item_log_drops_a_line_cut_short_and_names_every_commit_that_wrote_to_it(tmp_path):
    from hspec.eval.partial import ItemLog

    path = tmp_path / "e.partial.jsonl"
    first = ItemLog(path, {"K": [3, 5]}, "aaa")
    first.add("t", "t/0", [{"task": "t", "item": "t/0", "method": "none"}])
    with path.open("a") as f:
        f.write('{"task": "t", "item": "t/1", "comm')  # killed while writing item 1
    second = ItemLog(path, {"K": [3, 5]}, "bbb")
    assert second.done == {("t", "t/0")} and second.commits == ["aaa"]
    second.add("t", "t/1", [{"task": "t", "item": "t/1", "method": "none"}])
    third = ItemLog(path, {"K": [3, 5]}, "bbb")
    assert third.done == {("t", "t/0"), ("t", "t/1")} and third.commits == ["aaa", "bbb"]
    assert [r["item"] for r in third.records] == ["t/0", "t/1"]
    third.finish()
    assert not path.exists()


def test_a_report_names_the_weights_it_evaluated_and_keep_current_keeps_it_only_for_those(tmp_path, tiny_target,
                                                                                          monkeypatch):
    """The settings record each checkpoint's digest: `keep_current` returns a report made with the same
    weights without decoding, decodes again once the drafter is retrained in place, and a partial log of
    the old weights is refused rather than mixed with the new ones."""
    import torch

    from hspec.drafters import create_drafter
    from hspec.drafters.checkpoint import checkpoint_digest, save_drafter
    from hspec.eval.runner import MethodSpec, run_eval
    from hspec.sampling import SamplingParams

    target = _tiny_eval_setup(tmp_path, tiny_target, monkeypatch)
    checkpoint = tmp_path / "run" / "drafter"

    def train(seed):  # "training": weights that differ with the seed
        drafter = create_drafter("hspec", target.config, target_model=target.model)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        save_drafter(drafter, checkpoint, "tiny")

    train(0)
    args = ("tiny", [MethodSpec("hspec", str(checkpoint))], ["mt_bench"], 2, 3, SamplingParams(), 8, tmp_path / "out")
    first = run_eval(*args, "e", target=target)
    digest = checkpoint_digest(checkpoint)
    assert first["provenance"]["settings"]["checkpoints"] == {"hspec@run": digest}
    calls = []
    # warm-ups, item 1 (2 methods x 2 turns), then the first call of item 2
    counted = _counting_decoder(calls, interrupt_at=2 + 4 + 1)
    assert run_eval(*args, "e", target=target, keep_current=True, decoder=counted) == first and calls == []
    train(1)
    assert checkpoint_digest(checkpoint) != digest
    with pytest.raises(KeyboardInterrupt):  # retrained: decoded again, and cut short in its second item
        run_eval(*args, "e", target=target, keep_current=True, decoder=counted)
    train(0)  # other weights in place than the half-finished log's (the retrained ones): it is refused
    with pytest.raises(ValueError, match="settings that differ: checkpoints"):
        run_eval(*args, "e", target=target)


def test_decoding_options_reach_the_drafter_and_the_reports_settings(tmp_path, tiny_target, monkeypatch, capsys):
    """`drafter_options` (hspec eval --drafter-option) are set on each drafter of their kind and recorded per
    label, so a report made with other options is not kept as current; the CLI refuses an option no drafter
    of --drafters takes before loading anything."""
    from hspec import cli
    from hspec.drafters import create_drafter
    from hspec.drafters.checkpoint import save_drafter
    from hspec.eval import runner
    from hspec.runtime import build_drafter
    from hspec.sampling import SamplingParams

    target = _tiny_eval_setup(tmp_path, tiny_target, monkeypatch)
    save_drafter(create_drafter("specblock", target.config, target_model=target.model), tmp_path / "sb" / "drafter",
                 "tiny")
    built = []

    def recording(kind, *args, **kwargs):
        drafter = build_drafter(kind, *args, **kwargs)
        built.append((kind, getattr(drafter, "config", None)))
        return drafter

    methods = [runner.MethodSpec("specblock", str(tmp_path / "sb" / "drafter")), runner.MethodSpec("ngram")]
    payload = runner.run_eval("tiny", methods, ["mt_bench"], 1, 3, SamplingParams(), 8, tmp_path / "out", "e",
                              target=target, drafter_options={"specblock": {"node_budget": 5, "adapt_tree": False}},
                              build=recording)
    assert payload["provenance"]["settings"]["drafter_options"] == {"specblock@sb": {"node_budget": 5,
                                                                                   "adapt_tree": False}}
    (config,) = [c for kind, c in built if kind == "specblock"]
    assert config.node_budget == 5 and not config.adapt_tree
    code = cli.main(["eval", "--target", "nowhere", "--drafters", "ngram,dflash", "--drafter-option", "node_budget=5"])
    assert code == 2 and "'node_budget=5': no drafter here takes it" in capsys.readouterr().err


def test_the_methods_run_in_the_reverse_order_on_every_other_turn(tmp_path, tiny_target, monkeypatch):
    """Whatever a run leaves the CPU weighs on the run after it: plain decoding must not always run first."""
    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.eval.runner import MethodSpec, run_eval
    from hspec.sampling import SamplingParams

    target = _tiny_eval_setup(tmp_path, tiny_target, monkeypatch)
    kinds = []

    class Recording(SpeculativeDecoder):
        def generate(self, prompts, *args, **kwargs):
            kinds.append(self.drafter.kind)
            return super().generate(prompts, *args, **kwargs)

    payload = run_eval("tiny", [MethodSpec("ngram")], ["mt_bench"], 1, 3, SamplingParams(), 8, tmp_path, "order",
                       target=target, decoder=Recording)
    assert kinds == ["none", "ngram", "none", "ngram", "ngram", "none"]  # warm-ups, turn 1, turn 2 (2 turns an item)
    assert [r["method"] for r in payload["records"]] == ["none", "ngram", "none", "ngram"]  # records keep the order
