"""`export-drafter`: a bf16 copy loads back with bf16-rounded weights and the exact draft vocabulary."""

from __future__ import annotations

import pytest
import torch

from hspec.drafters import create_drafter
from hspec.drafters.checkpoint import export_drafter, load_drafter, save_drafter


def test_bf16_export_round_trip(tiny_target, tmp_path):
    torch.manual_seed(0)
    drafter = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    drafter.head.set_vocab(torch.randperm(tiny_target.config.vocab_size)[: drafter.config.draft_vocab_size])
    save_drafter(drafter, tmp_path / "fp32", verifier_name_or_path="tiny")
    export_drafter(tmp_path / "fp32", tmp_path / "bf16", torch.bfloat16)
    loaded = load_drafter(tmp_path / "bf16", tiny_target.model)
    assert torch.equal(loaded.head.draft_vocab_ids, drafter.head.draft_vocab_ids)
    for (name, a), b in zip(drafter.state_dict().items(), loaded.state_dict().values()):
        expected = a.to(torch.bfloat16).to(a.dtype) if a.is_floating_point() else a
        assert torch.equal(b, expected), name


def test_export_replaces_only_an_earlier_export(tiny_target, tmp_path, capsys):
    """The export replaces its destination whole: an earlier export may go, nothing else (a model folder, a
    folder of notes), and `hspec export-drafter` says so rather than deleting it."""
    from hspec.cli import main

    drafter = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    save_drafter(drafter, tmp_path / "fp32", verifier_name_or_path="tiny")
    export_drafter(tmp_path / "fp32", tmp_path / "bf16", torch.bfloat16)
    export_drafter(tmp_path / "fp32", tmp_path / "bf16", torch.float16)  # an earlier export: replaced
    assert load_drafter(tmp_path / "bf16", tiny_target.model) is not None
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')  # a HF model folder, not a drafter
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    for dst in (model, notes):
        with pytest.raises(FileExistsError, match=f"refusing to replace {dst}: it exists and is not a drafter"):
            export_drafter(tmp_path / "fp32", dst)
        assert main(["export-drafter", str(tmp_path / "fp32"), str(dst)]) == 2
        assert f"refusing to replace {dst}" in capsys.readouterr().err
    assert (model / "config.json").read_text() == '{"model_type": "llama"}'
    assert (notes / "todo.txt").read_text() == "keep me"
