"""`hspec bench train`: configurations interleaved on the same blocks, from the same weights; the page it writes."""

from __future__ import annotations

import math

import pytest
import torch

from hspec.bench.train import BenchConfig, bench_configs, compare_configs, markdown, round_blocks_for
from hspec.provenance import provenance


def test_configurations_are_the_product_of_the_axes():
    configs = bench_configs([4, 16], [16], ["fp32", "bf16-autocast"], [6e-4])
    assert [c.label for c in configs] == ["4x16 fp32 lr 0.0006", "4x16 bf16-autocast lr 0.0006",
                                          "16x16 fp32 lr 0.0006", "16x16 bf16-autocast lr 0.0006"]
    assert round_blocks_for(configs) == 256
    assert BenchConfig(2, 3, "fp32", 1e-3, compile=True).label == "2x3 fp32 lr 0.001 compiled"


def test_every_configuration_trains_the_same_blocks_and_is_reported(tiny_target, features):
    vocab = torch.arange(tiny_target.config.vocab_size)
    configs = bench_configs([1, 2], [2], ["fp32"], [3e-3])
    logs: list[str] = []
    result = compare_configs(tiny_target, "hspec", features.__getitem__, [0, 1, 2], [3], vocab, configs,
                             blocks=8, round_blocks=4, log=logs.append)
    assert [r["timed"] for r in result["rounds"]] == [False, True]  # round 0 is the warm-up
    first, second = result["configs"]
    assert (first["steps"], second["steps"]) == (4, 2)  # 8 blocks each, batched differently
    assert (first["timed_steps"], second["timed_steps"]) == (2, 1)  # round 1 only
    assert first["ratio_to_first"]["median"] == 1.0
    for c in result["configs"]:
        assert math.isfinite(c["held_out_loss"]) and c["blocks_per_s"] > 0
        assert 1.0 <= c["validation"]["mean_accepted_length"]
    payload = {"provenance": provenance("hspec bench train", {
        "kind": "hspec", "draft_vocab_size": 96, "device": "cpu", "threads": 1, "blocks": 8, "round_blocks": 4,
        "load_average_before": [0, 0, 0], "load_average_after": [0, 0, 0], "val_sequences": 1}), **result}
    page = markdown(payload)
    assert "| 1x2 fp32 lr 0.003 | 2 | 4 |" in page and "| 8 |" in page  # a row per config, the loss at 8 blocks
    assert len(logs) == 2 + 2  # a line per round and per configuration


def test_rounds_must_hold_whole_steps_of_every_configuration(tiny_target, features):
    configs = bench_configs([1, 2], [3], ["fp32"], [3e-3])
    with pytest.raises(ValueError, match="multiple of 6"):
        compare_configs(tiny_target, "hspec", features.__getitem__, [0, 1], [3],
                        torch.arange(tiny_target.config.vocab_size), configs, blocks=12, round_blocks=3)


def test_freed_memory_is_kept_where_glibc_is_the_allocator():
    """In a process of its own: the setting is the whole process's."""
    import subprocess
    import sys

    code = ("from hspec.training.memory import retain_freed_memory; kept = retain_freed_memory(); "
            "big = bytearray(64 << 20); print(kept, len(big) == 64 << 20 and 'torch' not in __import__('sys').modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "True" and (out[0] == "True" or not sys.platform.startswith("linux"))
