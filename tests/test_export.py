"""`export-drafter`: a bf16 copy loads back with bf16-rounded weights and the exact draft vocabulary."""

from __future__ import annotations

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
