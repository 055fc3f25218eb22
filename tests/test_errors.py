"""Bad input gets a clear error naming the bad value and what is allowed, and changes no state."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import load_tiny
from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters import create_drafter
from hspec.drafters.base import DraftBatch, Drafter, Proposal
from hspec.models.config import TargetConfig
from hspec.models.loading import load_target
from hspec.sampling import SamplingParams


def test_unknown_architecture(tiny_dirs, tmp_path):
    broken = tmp_path / "gpt2ish"
    shutil.copytree(tiny_dirs["llama"], broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported; allowed: .*LlamaForCausalLM"):
        load_tiny(broken)


def test_missing_and_corrupt_weights(tiny_dirs, tmp_path):
    missing = tmp_path / "missing"
    shutil.copytree(tiny_dirs["llama"], missing)
    (missing / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weight files in .*missing"):
        load_tiny(missing)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_dirs["llama"], corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00not a safetensors file")
    with pytest.raises(ValueError, match=r"weight file .*model.safetensors is corrupt"):
        load_tiny(corrupt)


def test_unknown_target_name():
    with pytest.raises(FileNotFoundError, match="neither a path nor a known name"):
        load_target("no-such-model-anywhere")


def test_bad_config_values():
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        TargetConfig("LlamaForCausalLM", 10, 8, 8, 1, 6, 4, 2)


def _decoder(target, kind="ngram", K=4):
    return SpeculativeDecoder(target.model, create_drafter(kind, target.config), K, target.tokenizer.eos_token_ids,
                              target.tokenizer.decode)


def test_prompt_longer_than_context_leaves_pool_unchanged(tiny_target):
    decoder = _decoder(tiny_target)
    pool = decoder.new_pool([[1] * 10], 10)
    context = tiny_target.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"more than the target's context of {context}"):
        decoder.generate([[5] * context], SamplingParams(), 8, pool=pool)
    assert pool.sequence_ids() == [] and pool.utilization() == 0.0


def test_out_of_vocabulary_prompt(tiny_target):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        _decoder(tiny_target).generate([[1, 2, 10_000]], SamplingParams(), 4)


def test_k_must_be_positive(tiny_target):
    with pytest.raises(ValueError, match="K .* must be >= 1, got 0"):
        _decoder(tiny_target, K=0)


def test_unknown_drafter_kind(tiny_target):
    with pytest.raises(ValueError, match=r"unknown drafter kind 'eagle9'; allowed: .*ngram"):
        create_drafter("eagle9", tiny_target.config)


class _WrongVocabDrafter(Drafter):
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def check_target(self, config: TargetConfig) -> None:
        if config.vocab_size != self.vocab_size:
            raise ValueError(f"drafter vocabulary {self.vocab_size} does not fit the target's {config.vocab_size}")

    def propose(self, batch: DraftBatch, K: int) -> Proposal:
        raise AssertionError("never called")


def test_drafter_that_does_not_fit_the_target(tiny_target):
    with pytest.raises(ValueError, match=f"vocabulary 7 does not fit the target's {tiny_target.config.vocab_size}"):
        SpeculativeDecoder(tiny_target.model, _WrongVocabDrafter(7), 4, ())


def test_pool_full_mid_generation_is_an_error_not_corruption(tiny_target):
    """A caller-supplied pool too small for the run raises PoolFullError before touching the model."""
    from hspec.cache.paged_pool import PoolFullError

    decoder = _decoder(tiny_target)
    pool = tiny_target.model.new_pool(num_pages=1, page_size=4)
    with pytest.raises(PoolFullError):
        decoder.generate([[1, 5, 6, 7, 8, 9, 10]], SamplingParams(), 4, pool=pool)
    assert torch.all(pool.k == 0) and pool.sequence_ids() == []


# ---- the command line: bad flags fail before any model is loaded -------------------------------------


def _cli_error(argv, capsys) -> str:
    """Run `hspec ARGV`, expect the one-line error exit (2), return the message."""
    from hspec import cli

    assert cli.main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("k", [0, 33, 5000])
def test_draft_length_out_of_range(k, capsys):
    from hspec.cli.options import MAX_DRAFT_LEN

    assert MAX_DRAFT_LEN == 32
    err = _cli_error(["generate", "--prompt", "hi", "--drafter", "ngram", "--k", str(k)], capsys)
    assert f"--k must be in 1..32 (tokens drafted per step), got {k}" in err
    err = _cli_error(["eval", "--drafters", "ngram", "--k", f"3,{k}"], capsys)  # each K of a sweep
    assert (f"--k must be in 1..32 (tokens drafted per step), got {k}" if k > 0
            else "expected positive integers, got '3,0'") in err


def test_empty_stop_string(capsys):
    err = _cli_error(["generate", "--prompt", "hi", "--stop", "</s>", "--stop", ""], capsys)
    assert "--stop needs a non-empty string, got ['</s>', '']" in err


@pytest.mark.parametrize("kind", ["ngram", "none"])
def test_drafter_path_for_a_model_free_kind(kind, tmp_path, capsys, tiny_target):
    err = _cli_error(["generate", "--prompt", "hi", "--drafter", kind, "--drafter-path", str(tmp_path)], capsys)
    assert f"--drafter-path {tmp_path} was given, but --drafter {kind} loads no checkpoint" in err
    from hspec.runtime import build_drafter

    with pytest.raises(ValueError, match=f"drafter '{kind}' is model-free and loads no checkpoint"):
        build_drafter(kind, tiny_target, tmp_path)
    assert build_drafter(kind, tiny_target).kind == kind  # without a path it still builds


def test_missing_data_dir_names_the_path_and_the_flag(tmp_path, capsys):
    missing = tmp_path / "no-data-here"
    err = _cli_error(["eval", "--drafters", "ngram", "--data-dir", str(missing)], capsys)
    assert str(missing) in err and "--data-dir" in err
    err = _cli_error(["data", "generate", "--data-dir", str(missing), "--out", str(tmp_path / "c.jsonl")], capsys)
    assert str(missing) in err and "--data-dir" in err
    assert not (tmp_path / "c.jsonl").exists() and not (tmp_path / "c.settings.json").exists()
