"""`hspec bench vllm-serve` pieces that need no vLLM: the streamed client and one level against a live
tiny `hspec` server, percentiles, /metrics parsing, row summaries, report and plot, server command lines.

The end-to-end run through vLLM's OpenAI server is `test_vllm_serve_smoke` (marker `vllm`).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hspec.bench.vllm_serve import (
    HSPEC_METRICS,
    LevelResult,
    RequestResult,
    VllmServeSettings,
    hspec_server_args,
    kv_capacity_tokens,
    metric_total,
    percentile,
    plot_throughput,
    render_markdown,
    run_level,
    summarize_level,
    vllm_server_args,
)
from hspec.cli import build_parser
from hspec.integrations.vllm.engine import VllmDrafter, ngram_config
from serving_helpers import MODEL, start_server

META = {"command": "test", "date": "-", "commit": "-", "settings": {},
        "machine": {"cuda": None, "processor": "x", "cpu_count": 1, "torch_threads": 1, "platform": "p", "torch": "t"}}


def test_percentile_interpolates_between_order_statistics():
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert percentile([7.0], 90) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 101)


def test_metrics_totals_and_kv_capacity_of_both_servers():
    samples = {'vllm:kv_cache_usage_perc{engine="0",model_name="m"}': 0.25,
               'vllm:kv_cache_usage_perc{engine="1",model_name="m"}': 0.5, "vllm:kv_cache_usage_perc_other": 9.0}
    assert metric_total(samples, "vllm:kv_cache_usage_perc") == 0.75
    vllm_text = ('# HELP vllm:cache_config_info x\nvllm:cache_config_info{block_size="16",cache_dtype="auto",'
                 'num_gpu_blocks="1456",prefix="{}"} 1.0\n')
    assert kv_capacity_tokens(vllm_text) == 1456 * 16
    assert kv_capacity_tokens("hspec_kv_cache_capacity_tokens 23296.0\n") == 23296
    assert kv_capacity_tokens('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n') is None


def _level(texts: list[str], concurrency: int) -> LevelResult:
    requests = [RequestResult(i, t, 10, 1.0 + i, 0.1 * (i + 1)) for i, t in enumerate(texts)]
    return LevelResult(concurrency, requests, elapsed_s=4.0, kv_samples=[0.1, 0.3],
                       metrics_before={"hspec_spec_decode_steps_total": 10.0},
                       metrics_after={"hspec_spec_decode_steps_total": 30.0,
                                      'hspec_spec_decode_accepted_tokens_total{position="1"}': 15.0,
                                      'hspec_spec_decode_accepted_tokens_total{position="2"}': 5.0})


def test_summary_counts_outputs_equal_to_the_reference_and_reads_tau_and_kv(tmp_path):
    row = summarize_level("ngram", "hspec", _level(["a", "b", "c"], 2), HSPEC_METRICS, ["a", "x", "c"], 23296)
    assert row["outputs_equal_plain_batch1"] == 2 and row["num_requests"] == 3
    assert row["output_tok_s"] == 30 / 4.0 and row["latency_p50_s"] == 2.0
    assert row["ttft_p90_s"] == pytest.approx(0.28)
    assert row["kv_usage_mean"] == pytest.approx(0.2) and row["kv_usage_peak"] == 0.3
    assert row["tau"] == 1.0 + 20 / 20
    plain = summarize_level("none", "hspec", _level(["a", "b", "c"], 2), HSPEC_METRICS, None, None)
    assert plain["outputs_equal_plain_batch1"] is None

    markdown = render_markdown(META, [plain, row])
    assert "| ngram | hspec | 2 | 7.5 | 1.00x |" in markdown and "2/3" in markdown
    assert plot_throughput([plain, row], tmp_path / "p.png").stat().st_size > 1000


def test_server_command_lines():
    settings = VllmServeSettings(concurrency=(2, 8), dtype="float32", max_model_len=512)
    drafter = VllmDrafter("hspec", {"method": "custom_class", "model": "a.B", "num_speculative_tokens": 7},
                          {"hspec_drafter": "/ckpt"})
    args = vllm_server_args(Path("/m"), drafter, settings, "smollm2", 1234)
    assert args[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--enforce-eager" in args
    assert args[args.index("--max-num-seqs") + 1] == "8" and args[args.index("--port") + 1] == "1234"
    assert json.loads(args[args.index("--speculative-config") + 1])["num_speculative_tokens"] == 7
    assert json.loads(args[args.index("--hf-overrides") + 1]) == {"hspec_drafter": "/ckpt"}
    plain = vllm_server_args(Path("/m"), VllmDrafter("none", None), settings, "smollm2", 1)
    assert "--speculative-config" not in plain
    assert "--speculative-config" in vllm_server_args(Path("/m"), VllmDrafter("ngram", ngram_config(5)), settings,
                                                      "smollm2", 1)
    hs = hspec_server_args("smollm2", "hspec", Path("/ckpt"), 7, settings, "smollm2", 99)
    assert hs[hs.index("--kv-budget-mib") + 1] == "1024" and hs[hs.index("--drafter-path") + 1] == "/ckpt"
    assert hs[hs.index("--k") + 1] == "7" and hs[hs.index("--max-running") + 1] == "8"


def test_settings_and_command_line():
    with pytest.raises(ValueError, match="concurrency"):
        VllmServeSettings(concurrency=(0,))
    with pytest.raises(ValueError, match="dtype"):
        VllmServeSettings(dtype="float16")
    args = build_parser().parse_args(["bench", "vllm-serve", "--drafters", "none,hspec", "--concurrency", "2",
                                      "--num-requests", "2", "--max-tokens", "8"])
    assert args.concurrency == "2" and args.num_requests == 2 and args.dtype == "float32"


def test_one_level_streams_against_a_live_hspec_server(chat_target):
    prompts = ["hello there", "abcabcabc", "zz top"]
    with start_server(chat_target, "ngram", num_pages=256) as srv:
        level = asyncio.run(run_level(srv.url, MODEL, prompts, 2, 6, HSPEC_METRICS.kv_usage, 0.05))
        again = asyncio.run(run_level(srv.url, MODEL, prompts, 1, 6, HSPEC_METRICS.kv_usage, 0.05))
    assert [r.index for r in level.requests] == [0, 1, 2]
    assert all(r.completion_tokens > 0 and r.ttft_s is not None and r.ttft_s <= r.latency_s for r in level.requests)
    assert level.kv_samples and all(0 <= s <= 1 for s in level.kv_samples)
    assert [r.text for r in again.requests] == [r.text for r in level.requests]  # greedy: concurrency-invariant
    row = summarize_level("ngram", "hspec", level, HSPEC_METRICS, [r.text for r in again.requests], None)
    assert row["outputs_equal_plain_batch1"] == 3 and row["tau"] is not None


@pytest.mark.vllm
def test_vllm_serve_smoke(tmp_path):
    """The whole command, tiny: vLLM's OpenAI server plain and with H-Spec, then `hspec serve` with each."""
    pytest.importorskip("vllm")
    from hspec.bench.vllm_serve import run_vllm_serve_bench

    settings = VllmServeSettings(drafters="none,hspec", concurrency=(2,), num_requests=2, max_tokens=8,
                                 max_model_len=512, out=str(tmp_path))
    assert run_vllm_serve_bench(settings, "test") == 0
    rows = json.loads((tmp_path / "serve_float32.json").read_text())["rows"]
    assert [(r["drafter"], r["engine"], r["concurrency"]) for r in rows] == [
        ("none", "vllm", 1), ("none", "vllm", 2), ("hspec", "vllm", 2), ("none", "hspec", 2), ("hspec", "hspec", 2)]
    assert all(r["outputs_equal_plain_batch1"] == 2 for r in rows)  # float32 greedy: batching changes nothing
    assert all(r["output_tokens"] > 0 and r["ttft_p50_s"] is not None and r["kv_capacity_tokens"] for r in rows)
    assert rows[2]["tau"] is not None and rows[2]["kv_capacity_tokens"] == rows[0]["kv_capacity_tokens"]
    assert (tmp_path / "serve_float32.md").exists() and (tmp_path / "serve_float32_throughput.png").exists()
