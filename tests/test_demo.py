"""The README's main job, `hspec demo`, on a tiny target: its table, the costs `:auto` decides by, the check."""

from __future__ import annotations

import time

from conftest import load_tiny
from hspec.demo import demo_on


def test_the_demo_prints_each_method_and_the_costs_auto_decides_by(tiny_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HSPEC_CACHE", str(tmp_path))  # the measured costs are cached here, not in ~/.cache
    target = load_tiny(tiny_dirs["llama"])  # no HF tokenizer in a tiny checkpoint: conftest's byte tokenizer
    assert demo_on(target, ["ngram", "ngram:auto"], 3, 6, ["Hello there."], time.perf_counter()) == 0
    out = capsys.readouterr().out
    table = out[out.index("method"):]
    assert [line.split()[0] for line in table.splitlines()[1:4]] == ["none", "ngram", "ngram:auto"]
    costs = next(line for line in out.splitlines() if line.startswith("this machine's step costs"))
    assert "ngram:auto a draft" in costs and costs.count("a draft") == 1  # plain n-gram decides by no costs
    assert "all outputs identical to plain greedy decoding" in out
