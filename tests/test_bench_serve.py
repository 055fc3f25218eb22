"""`hspec bench serve` pieces: KV capacity per kind, one closed-loop level against a live tiny server,
the report files, and the command line."""

from __future__ import annotations

import asyncio

import pytest

from hspec.bench.serve import ServeBenchSettings, _markdown, _plots, kv_capacity_table, run_level, server_configs
from hspec.cli import build_parser
from hspec.drafters import DRAFTERS
from serving_helpers import MODEL, start_server


def test_kv_capacity_counts_drafter_layers(chat_target):
    rows = {r["drafter"]: r for r in kv_capacity_table(chat_target, 4 << 20, page_size=16)}
    assert set(rows) == set(DRAFTERS.names())
    plain = rows["none"]
    assert plain["drafter_kv_layers"] == 0 and plain["kv_inflation"] == 1.0
    for row in rows.values():
        assert "error" not in row, row
        layers = chat_target.config.num_layers + row["drafter_kv_layers"]
        assert row["capacity_tokens"] == (4 << 20) // (row["kv_bytes_per_token"] * 16) * 16
        assert row["kv_bytes_per_token"] == plain["kv_bytes_per_token"] * layers // chat_target.config.num_layers


def test_one_level_against_a_live_server(chat_target, tmp_path):
    settings = ServeBenchSettings(drafters=("ngram",), concurrency=(3,), K=4, max_tokens=12, level_seconds=1.5)
    with start_server(chat_target, "ngram", num_pages=256) as srv:
        result = asyncio.run(run_level(srv.url, MODEL, ["hello there", "abcabcabc", "zz top"], 3, settings))
    assert result["num_requests"] >= 3 and result["output_tokens"] > 0 and result["throughput_tok_s"] > 0
    assert 0 < result["mean_kv_utilization"] <= 1 and result["mean_accepted_length"] >= 1
    assert 1 <= result["mean_batch"] <= 3

    levels = {"none": [dict(result, throughput_tok_s=10.0)], "ngram": [result]}
    payload = {"provenance": {"command": "test", "date": "-", "commit": "-", "settings": {},
                              "machine": {"cuda": None, "processor": "x", "cpu_count": 1, "torch_threads": 1,
                                          "platform": "p", "torch": "t"}},
               "levels": levels, "kv_capacity": kv_capacity_table(chat_target, 1 << 20, 16)}
    markdown = _markdown(payload, settings)
    assert "| ngram | 3 |" in markdown and "KV capacity" in markdown
    paths = _plots(levels, tmp_path)
    assert all(p.stat().st_size > 1000 for p in paths)


def test_command_line_parses():
    args = build_parser().parse_args(["bench", "serve", "--drafters", "none,ngram", "--concurrency", "8,16",
                                      "--drafter-path", "hspec=/x"])
    assert args.concurrency == "8,16" and args.drafter_path == ["hspec=/x"]
    args = build_parser().parse_args(["serve", "--port", "0", "--drafter", "none", "--kv-pages", "64"])
    assert args.port == 0 and args.kv_pages == 64 and args.host == "127.0.0.1"
    with pytest.raises(ValueError, match="not in --drafters"):
        ServeBenchSettings(drafters=("none",), drafter_paths=(("hspec", "/x"),))
    with pytest.raises(ValueError, match="unknown drafter kind"):
        ServeBenchSettings(drafters=("nope",))


def test_every_server_runs_the_dtype_asked_for(tmp_path, monkeypatch):
    from hspec.bench import serve

    launched = []
    monkeypatch.setattr(serve.subprocess, "Popen", lambda args, **kw: launched.append(args))
    args = build_parser().parse_args(["bench", "serve", "--dtype", "int8", "--drafters", "none"])
    assert args.dtype == "int8"
    settings = ServeBenchSettings(dtype="bfloat16", drafters=("none",))
    serve.ServerProcess("none", "none", None, settings, tmp_path / "log")
    assert launched[0][launched[0].index("--dtype") + 1] == "bfloat16"
    with pytest.raises(ValueError,
                       match="dtype must be one of auto, fastest, float32, bfloat16, int8, int4, w4a8, got 'fp16'"):
        ServeBenchSettings(dtype="fp16")


def test_each_drafting_kind_is_served_once_per_speculation_limit(tmp_path, monkeypatch):
    from hspec.bench import serve
    from hspec.cli.bench import spec_limits

    args = build_parser().parse_args(["bench", "serve", "--drafters", "none,hspec", "--spec-max-batch", "none,2"])
    settings = ServeBenchSettings(drafters=tuple(args.drafters.split(",")), speculate_max_batch=spec_limits(
        args.spec_max_batch))
    assert server_configs(settings) == [("none", "none", None), ("hspec", "hspec", None), ("hspec b<=2", "hspec", 2)]
    launched = []
    monkeypatch.setattr(serve.subprocess, "Popen", lambda args, **kw: launched.append(args))
    for label, kind, limit in server_configs(settings):
        serve.ServerProcess(label, kind, limit, settings, tmp_path / f"{kind}{limit}.log")
    assert ["--spec-max-batch" in a for a in launched] == [False, False, True]
    assert launched[2][launched[2].index("--spec-max-batch") + 1] == "2"
    with pytest.raises(ValueError, match=r"--spec-max-batch must be comma-separated integers >= 0 or `none`"):
        spec_limits("two")
    with pytest.raises(ValueError, match=r"speculate_max_batch must be distinct integers >= 0 or None.*-1"):
        ServeBenchSettings(speculate_max_batch=(None, -1))
