"""KV accounting (the paper's Table 1) and `hspec drafters describe`."""

from __future__ import annotations

import json

import pytest

from hspec.cli import main
from hspec.drafters import DRAFTERS
from hspec.drafters.describe import describe_kinds, format_descriptions
from hspec.models.kv_accounting import KNOWN_TARGETS, format_kv_table, known_target, kv_bytes_per_token, kv_table


def test_table1_numbers():
    """Paper Table 1: a 5-layer DFlash drafter inflates KV by 1.139 / 1.139 / 1.156; H-Spec by 1.000."""
    got = {(r.target, r.drafter): round(r.kv_inflation, 3) for r in kv_table()}
    assert got[("qwen3-4b", "DFlash (5 layers)")] == 1.139
    assert got[("qwen3-8b", "DFlash (5 layers)")] == 1.139
    assert got[("llama-3.1-8b-instruct", "DFlash (5 layers)")] == 1.156
    assert got[("smollm2-135m", "DFlash (5 layers)")] == round(1 + 5 / 30, 3)
    for t in KNOWN_TARGETS:
        assert got[(t.name, "H-Spec")] == 1.0


def test_known_configs_are_the_published_values():
    c = known_target("Qwen3-8B").config
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        36, 8, 128, 4096, 12288, 151936)
    c = known_target("llama-3.1-8b-instruct").config
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        32, 8, 128, 4096, 14336, 128256)
    c = known_target("smollm2-135m").config
    assert (c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        30, 3, 64, 576, 1536, 49152)
    assert kv_bytes_per_token(36, 8, 128, 2) == 147456
    with pytest.raises(ValueError, match="known"):
        known_target("gpt-5")


def test_kv_table_cli(capfd):
    assert main(["kv-table", "--json"]) == 0
    rows = json.loads(capfd.readouterr().out)
    assert {"target", "drafter", "kv_inflation", "drafter_kv_bytes_per_token"} <= set(rows[0])
    assert main(["kv-table"]) == 0
    assert "| qwen3-8b | DFlash (5 layers) |" in capfd.readouterr().out
    assert "1.156" in format_kv_table(kv_table())


def test_describe_fields_for_a_literal_target():
    """Built on the meta device (no weights): every kind, with the memory claims of docs/design.md#h-spec
    and docs/design.md#dflash-family."""
    rows = {r.kind: r for r in describe_kinds("smollm2-135m")}
    assert set(rows) == set(DRAFTERS.names())
    c = known_target("smollm2-135m").config
    per_layer = 2 * c.num_kv_heads * c.head_dim * 2  # bf16
    assert rows["dflash"].drafter_kv_bytes_per_token == 5 * per_layer
    assert rows["dspark"].drafter_kv_bytes_per_token == 5 * per_layer
    assert rows["peagle"].drafter_kv_bytes_per_token == rows["peagle"].drafter_kv_layers * per_layer > 0
    for kind in ("dflash-kvreuse", "hspec", "ngram", "none"):
        assert rows[kind].drafter_kv_bytes_per_token == 0 and rows[kind].kv_inflation == 1.0
    assert rows["dflash"].kv_inflation == pytest.approx(1 + 5 / 30)
    assert rows["hspec"].per_sequence_state_bytes == 5 * c.hidden_size * 2
    assert rows["dflash-kvreuse"].per_sequence_state_bytes == 0
    assert rows["dspark"].trainable_params > rows["dflash"].trainable_params > rows["dflash-kvreuse"].trainable_params
    assert rows["ngram"].trainable_params == 0
    assert "| dspark |" in format_descriptions(list(rows.values()))


def test_describe_cli_json(capfd):
    assert main(["drafters", "describe", "--target", "qwen3-8b", "--json"]) == 0
    rows = json.loads(capfd.readouterr().out)
    by_kind = {r["kind"]: r for r in rows}
    for r in rows:
        assert {"kind", "trainable_params", "total_params", "drafter_kv_bytes_per_token",
                "per_sequence_state_bytes", "kv_inflation"} <= set(r)
    assert round(by_kind["dflash"]["kv_inflation"], 3) == 1.139
    assert by_kind["hspec"]["drafter_kv_bytes_per_token"] == 0
