"""Training precision: bf16 autocast over fp32 master weights trains, is recorded, and is kept on resume."""

from __future__ import annotations

import json

import pytest
import torch

from hspec.drafters import create_drafter
from hspec.training.precision import precision_context, resolve_precision
from hspec.training.precision_bench import compare_precisions
from hspec.training.trainer import TrainConfig, Trainer


def _trainer(tiny_target, features, precision, steps=30, lr=3e-3, seed=0):
    torch.manual_seed(seed)
    drafter = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    config = TrainConfig(steps=steps, lr=lr, seqs_per_step=4, anchors_per_seq=8, seed=3, precision=precision)
    return Trainer(drafter, tiny_target.model, features.__getitem__, list(range(len(features))), config)


def test_bf16_autocast_trains_with_finite_decreasing_loss_and_fp32_master_state(tiny_target, features):
    trainer = _trainer(tiny_target, features, "bf16-autocast")
    losses = [trainer.train_step(step).loss for step in range(30)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    # The master weights, their gradients and AdamW's moments stay fp32; only the forward ran in bf16.
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in trainer.params)
    moments = [s[k] for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and all(m.dtype == torch.float32 for m in moments)


def test_bf16_autocast_rounds_the_forward_but_not_the_loss_or_the_teacher(tiny_target, features):
    fp32, bf16 = (_trainer(tiny_target, features, p) for p in ("fp32", "bf16-autocast"))
    loss32, loss16 = fp32.compute_gradients(0)[0], bf16.compute_gradients(0)[0]
    assert loss16 != loss32 and loss16 == pytest.approx(loss32, rel=2e-2)  # autocast is on, and close
    feats, positions = features[1], torch.arange(12, 30)
    feats, rows = feats.with_teacher(tiny_target.model), tiny_target.model.lm_head_weight()
    with precision_context("bf16-autocast", "cpu"):
        under_autocast = feats.teacher(rows, positions).on_vocab
    assert under_autocast.dtype == torch.float32
    assert torch.equal(under_autocast, feats.teacher(rows, positions).on_vocab)


def test_fp32_is_the_recipe_default_and_matches_the_code_before_precisions():
    assert TrainConfig().precision == "fp32"
    assert resolve_precision("fp32") == "fp32" and resolve_precision("bf16-autocast") == "bf16-autocast"


@pytest.mark.parametrize(("device", "flags", "expected"), [
    ("cpu", frozenset({"avx2", "avx512_bf16"}), "bf16-autocast"),
    ("cpu", frozenset({"avx2", "amx_bf16"}), "bf16-autocast"),
    ("cpu", frozenset({"avx2", "fma"}), "fp32"),  # bf16 emulated in software: slower (results/train_precision_cpu.md)
    ("cpu", frozenset(), "fp32"),
    ("cuda", frozenset(), "bf16-autocast"),
])
def test_auto_precision_follows_the_hardware(device, flags, expected):
    assert resolve_precision("auto", device, flags) == expected


def test_bad_precisions_name_the_value_and_what_is_allowed():
    with pytest.raises(ValueError, match=r"'bf16'.*auto, fp32, bf16-autocast"):
        resolve_precision("bf16")
    with pytest.raises(ValueError, match=r"precision must be one of auto, fp32, bf16-autocast, got 'fp16'"):
        TrainConfig(precision="fp16")
    with pytest.raises(ValueError, match=r"resolve 'auto' first"):
        precision_context("auto", "cpu")


def test_cli_refuses_an_unknown_precision(capsys):
    from hspec.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--drafter", "hspec", "--precision", "bf16"])
    assert "'bf16' is not a training precision; allowed: auto, fp32, bf16-autocast" in capsys.readouterr().err


def _config_record(run_dir):
    return json.loads((run_dir / "history.jsonl").read_text().split("\n")[0])


WITHOUT_BF16 = frozenset({"avx2", "fma"})  # an AVX2 CPU: bf16 emulated
WITH_BF16 = frozenset({"avx2", "fma", "avx512_bf16"})  # bf16 dot products in hardware


def test_the_run_records_its_resolved_precision_and_resume_keeps_it(tmp_path, train_tiny, capsys):
    auto = tmp_path / "auto"
    train_tiny(auto, precision="auto", cpu_flags=WITHOUT_BF16)
    assert _config_record(auto)["settings"]["precision"] == "fp32" and _config_record(auto)["precision"] == "fp32"

    run = tmp_path / "run"
    train_tiny(run, precision="bf16-autocast")
    assert _config_record(run)["settings"]["precision"] == "bf16-autocast"
    with pytest.raises(ValueError, match=r"changed: --precision bf16-autocast -> fp32\. .*--override"):
        train_tiny(run, precision="fp32")
    capsys.readouterr()
    # auto keeps the recorded bf16, on any machine
    train_tiny(run, precision="auto", steps=4, override=True, cpu_flags=WITHOUT_BF16)
    out = capsys.readouterr().out
    assert "precision bf16-autocast" in out and "--precision" not in out
    train_tiny(run, precision="fp32", steps=4, override=True)
    records = [json.loads(line) for line in (run / "history.jsonl").read_text().split("\n") if line]
    assert records[-1] == {"event": "override", "step": 4, "changed": {"precision": ["bf16-autocast", "fp32"]}}


def test_a_run_recorded_before_precisions_existed_resumes_as_fp32(tmp_path, train_tiny):
    run = tmp_path / "run"
    train_tiny(run, precision="fp32")
    lines = (run / "history.jsonl").read_text().split("\n")
    config = json.loads(lines[0])
    del config["precision"], config["settings"]["precision"]
    (run / "history.jsonl").write_text("\n".join([json.dumps(config), *lines[1:]]))
    train_tiny(run, precision="auto", cpu_flags=WITH_BF16)  # the fp32 it trained in, not this CPU's bf16
    with pytest.raises(ValueError, match=r"--precision fp32 -> bf16-autocast"):
        train_tiny(run, precision="bf16-autocast")


def test_the_precision_comparison_interleaves_from_one_initialisation(tiny_target, features):
    vocab = torch.arange(tiny_target.config.vocab_size)
    config = TrainConfig(steps=4, seqs_per_step=2, anchors_per_seq=4, seed=3)
    result = compare_precisions(tiny_target, "hspec", features.__getitem__, [0, 1, 2], [3], vocab, config,
                                round_steps=2, log=lambda line: None)
    assert [r["order"] for r in result["rounds"]] == [["fp32", "bf16-autocast"], ["bf16-autocast", "fp32"]]
    for precision in ("fp32", "bf16-autocast"):
        row = result["summary"][precision]
        assert row["steps_per_s"] > 0 and row["validation"]["mean_accepted_length"] >= 1
    with pytest.raises(ValueError, match="round_steps must be >= 1 and divide steps"):
        compare_precisions(tiny_target, "hspec", features.__getitem__, [0], [3], vocab, config, round_steps=3)
