"""`hspec train` end to end on a tiny target: features -> pruned vocabulary -> steps -> saved drafter,
and `hspec bench draft` with a chosen draft vocabulary."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from hspec.bench import draft as draft_bench
from hspec.drafters.checkpoint import load_drafter, save_drafter
from hspec.drafters.common import kv_layer_of, select_target_layers
from hspec.training import run as train_run
from hspec.training.store import FeatureStore
from hspec.training.trainer import TrainConfig, Trainer


def test_train_with_a_smaller_draft_vocabulary(tmp_path, tiny_target, feature_dir):
    config = TrainConfig(steps=2, seqs_per_step=2, anchors_per_seq=2)
    saved = train_run.train("hspec", "tiny", [feature_dir], tmp_path / "run", config, val_every=2,
                            draft_vocab_size=20, target=tiny_target)
    drafter = load_drafter(saved, tiny_target.model)
    assert drafter.config.draft_vocab_size == 20
    store = FeatureStore(feature_dir)
    counts = Counter(t for i in store.available() if not train_run.is_validation(store.ids[i])
                     for t in store.tokens(i).tolist())
    kept = set(drafter.head.draft_vocab_ids.tolist())
    least_kept = min(counts.get(t, 0) for t in kept)
    assert all(counts[t] <= least_kept for t in counts if t not in kept)  # the most frequent tokens
    first = json.loads((tmp_path / "run" / "history.jsonl").read_text().split("\n")[0])
    train_ids = [i for i in store.available() if not train_run.is_validation(store.ids[i])]
    inside = sum(counts[t] for t in kept)
    assert first["draft_vocab_coverage"]["train"] == pytest.approx(inside / sum(counts.values()))
    assert first["draft_vocab_size"] == 20 and first["train_tokens"] == sum(store.lengths[i] for i in train_ids)
    from hspec.training.report import write_training_report

    report = write_training_report([tmp_path / "run"], tmp_path / "report.md", "tiny").read_text()
    assert "draft_vocab_size=20" in report and f"| {first['train_tokens']} |" in report


def test_bench_draft_with_a_draft_vocabulary(tmp_path, tiny_target):
    draft_bench.run_draft_bench("tiny", ["hspec", "ngram"], tmp_path, repeats=1, batch_sizes=(1,), contexts=(16,),
                                draft_vocab_size=24, target=tiny_target)
    payload = json.loads((tmp_path / "draft_cost_cpu_vp24.json").read_text())
    assert payload["provenance"]["settings"]["draft_vocab_size"] == 24
    assert "--draft-vocab 24" in payload["provenance"]["command"]
    # H-Spec proposes one CPU sequence natively: the row without the native call is timed beside it
    assert set(payload["results"][0]["kinds"]) == {"hspec", "ngram", f"hspec {draft_bench.WITHOUT_NATIVE}"}
    assert payload["results"][0]["kinds"]["hspec"]["propose_cpu_ms"]["n"] == 1


@pytest.mark.filterwarnings("ignore:No complete tensor found")  # torch.export.load of CPU weights
def test_bench_draft_times_a_compiled_kind_with_and_without_its_ahead_of_time_library(tmp_path, tiny_target,
                                                                                    monkeypatch):
    """AOTInductor's build of a C++ library (30-40 s) stands in as torch.export's own save and load, so the
    exported program runs as exported; the loads say which rows reached the ahead-of-time path."""
    import torch._inductor

    from hspec.drafters import compile as compile_module

    monkeypatch.setattr(compile_module.torch, "compile", lambda fn, **_: fn)
    monkeypatch.setenv("HSPEC_CACHE", str(tmp_path / "cache"))
    loaded = []
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",
                        lambda program, package_path: torch.export.save(program, package_path))
    monkeypatch.setattr(torch._inductor, "aoti_load_package",
                        lambda path: loaded.append(path) or torch.export.load(path).module())
    draft_bench.run_draft_bench("tiny", ["hspec", "ngram"], tmp_path, repeats=2, batch_sizes=(1,), contexts=(16,),
                                target=tiny_target, compile_drafters=True)
    payload = json.loads((tmp_path / "draft_cost_cpu_compiled.json").read_text())
    twin = f"hspec {draft_bench.TORCH_COMPILE_ONLY}"
    without_native = f"hspec {draft_bench.WITHOUT_NATIVE}"
    assert set(payload["results"][0]["kinds"]) == {"hspec", "ngram", twin, without_native}
    assert twin in (tmp_path / "draft_cost_cpu_compiled.md").read_text()
    # only the row without the native call went there (the first proposes natively, the twin by torch.compile):
    # one library, its greedy proposal at the one block length and context layout timed, loaded once
    assert [Path(path).name.split("-K")[0] for path in loaded] == ["hspec-draft_greedy"]


def test_draft_vocabulary_of_a_model_free_kind_is_refused(tiny_target):
    from hspec.drafters import drafter_config

    with pytest.raises(ValueError, match="'ngram'"):
        drafter_config("ngram", tiny_target.config, draft_vocab_size=10)


def test_train_from_a_saved_drafter_starts_from_its_weights_and_vocabulary(tmp_path, tiny_target, feature_dir):
    first = train_run.train("hspec", "tiny", [feature_dir], tmp_path / "first", TrainConfig(steps=2,
                            seqs_per_step=2, anchors_per_seq=2), val_every=2, draft_vocab_size=20,
                            target=tiny_target)
    start = load_drafter(first, tiny_target.model)
    # a vocabulary the data would never choose (the 20 highest ids), so keeping it is visible
    start.head.set_vocab(torch.arange(tiny_target.config.vocab_size - 20, tiny_target.config.vocab_size))
    save_drafter(start, tmp_path / "start", verifier_name_or_path="tiny",
                 verifier_architectures=[tiny_target.config.architecture])

    tuned_dir = train_run.train("hspec", "tiny", [feature_dir], tmp_path / "tuned",
                                TrainConfig(steps=1, lr=1e-5, seqs_per_step=2, anchors_per_seq=2), val_every=1,
                                init_from=tmp_path / "start", target=tiny_target)
    tuned = load_drafter(tuned_dir, tiny_target.model)
    assert torch.equal(tuned.head.draft_vocab_ids, start.head.draft_vocab_ids)
    before, after = start.drafter_state_dict(), tuned.drafter_state_dict()
    moved = max((after[k].float() - before[k].float()).abs().max().item() for k in before)
    assert 5e-6 < moved < 2e-5  # one Adam step of lr 1e-5 from the saved weights (they train, from there)
    history = json.loads((tmp_path / "tuned" / "history.jsonl").read_text().split("\n")[0])
    assert history["init_from"] == str(tmp_path / "start")
    from hspec.training.report import write_training_report

    report = write_training_report([tmp_path / "first", tmp_path / "tuned"], tmp_path / "report.md", "t").read_text()
    assert f"tuned starts from the drafter `{tmp_path / 'start'}`" in report

    with pytest.raises(ValueError, match="holds a 'hspec' drafter, not the 'dflash'"):
        train_run.train("dflash", "tiny", [feature_dir], tmp_path / "wrong_kind", TrainConfig(steps=1),
                        init_from=tmp_path / "start", target=tiny_target)
    with pytest.raises(ValueError, match="--draft-vocab 30 differs"):
        train_run.train("hspec", "tiny", [feature_dir], tmp_path / "wrong_vocab", TrainConfig(steps=1),
                        draft_vocab_size=30, init_from=tmp_path / "start", target=tiny_target)


def test_report_continues_the_step_axis_of_the_run_a_drafter_started_from():
    from hspec.training.report import _steps_before

    runs = {"base": {"config": {"steps": 500}}, "tuned": {"config": {"steps": 300, "init_from": "x/base/drafter"}},
            "again": {"config": {"steps": 10, "init_from": "y/tuned/drafter"}},
            "elsewhere": {"config": {"steps": 10, "init_from": "z/other/drafter"}}}
    assert [_steps_before(runs[n], runs) for n in runs] == [0, 500, 800, 0]


def test_report_shows_the_validation_in_decode_order_where_a_run_has_it(tmp_path):
    from hspec.metrics import acceptance_stats
    from hspec.training.report import write_training_report

    anchors, in_order = acceptance_stats([3, 1, 2, 0], 3), acceptance_stats([3, 0, 0, 1], 3)
    for name, final in (("old", anchors.to_dict()), ("new", {**anchors.to_dict(), "decode_order": in_order.to_dict()})):
        (tmp_path / name).mkdir()
        records = [{"event": "config", "steps": 2, "train_sequences": 5, "val_sequences": 1},
                   {"event": "step", "step": 0, "loss": 1.0, "seconds": 0.5},
                   {"event": "validation", "step": 2, **final}]
        (tmp_path / name / "history.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    report = write_training_report([tmp_path / "old", tmp_path / "new"], tmp_path / "r.md", "t").read_text()
    rows = {line.split(" | ")[0]: line for line in report.split("\n") if line.startswith(("| old", "| new"))}
    assert f"| {anchors.mean_accepted_length:.2f} | - |" in rows["| old"]
    assert f"| {anchors.mean_accepted_length:.2f} | {in_order.mean_accepted_length:.2f} |" in rows["| new"]


def test_validate_reports_both_validations_of_saved_drafters_on_the_held_out_split(tmp_path, tiny_target):
    from hspec.drafters import create_drafter

    held_out = [f"seq/{i}" for i in range(400) if train_run.is_validation(f"seq/{i}")][:2]
    g = torch.Generator().manual_seed(4)
    V = tiny_target.config.vocab_size
    records = [{"id": rid, "prompt_ids": torch.randint(3, V, (8,), generator=g).tolist(),
                "response_ids": torch.randint(3, V, (30,), generator=g).tolist()} for rid in [*held_out, "seq/train"]]
    layers = select_target_layers(tiny_target.config.num_layers)
    FeatureStore.build(tmp_path / "features", tiny_target.model, "tiny", records, layers,
                       [kv_layer_of(x) for x in layers])
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        drafter = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
        paths.append(save_drafter(drafter, tmp_path / f"d{seed}", verifier_name_or_path="tiny",
                                  verifier_architectures=["LlamaForCausalLM"]))
    json_path, md_path = train_run.validate_drafters("tiny", [tmp_path / "features"], paths, tmp_path / "out",
                                                     target=tiny_target)
    rows = json.loads(json_path.read_text())["drafters"]
    assert [r["drafter"] for r in rows] == [str(p) for p in paths]
    store = FeatureStore(tmp_path / "features")
    val_ids = [i for i in store.available() if store.ids[i] in held_out]
    assert len(val_ids) == 2
    trainer = Trainer(load_drafter(paths[1], tiny_target.model), tiny_target.model, store.load, val_ids,
                      TrainConfig(steps=1))
    assert rows[1]["decode_order"] == trainer.validate_in_decode_order(val_ids).to_dict()
    assert rows[1]["anchors"] == trainer.validate(val_ids).to_dict()
    assert f"| `{paths[1]}` | hspec | {rows[1]['anchors']['mean_accepted_length']:.3f} |" in md_path.read_text()


def test_resume_refuses_changed_settings_unless_overridden(tmp_path, train_tiny, capsys):
    run = tmp_path / "run"
    train_tiny(run)
    written = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    assert train_tiny(run) == run / "drafter"  # the same settings resume: nothing left to do, nothing rewritten
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == written
    assert "has finished its 2 steps" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"changed: --steps 2 -> 4, --lr 0.0006 -> 0.001\. .*--override"):
        train_tiny(run, steps=4, lr=1e-3)
    with pytest.raises(ValueError, match=r"changed: --seqs-per-step 2 -> 3\b"):
        train_tiny(run, seqs_per_step=3)
    assert [p.name for p in (run / "state").iterdir()] == ["step-000000002"]  # nothing was trained or written

    train_tiny(run, override=True, steps=4)
    assert "--override: continuing with --steps 2 -> 4" in capsys.readouterr().out
    records = [json.loads(line) for line in (run / "history.jsonl").read_text().split("\n") if line]
    overrides = [r for r in records if r["event"] == "override"]
    assert overrides == [{"event": "override", "step": 2, "changed": {"steps": [2, 4]}}]
    assert max(r["step"] + 1 for r in records if r["event"] == "step") == 4  # it trained on to the new end
    train_tiny(run, steps=4)  # the overridden settings are now the recorded ones
    with pytest.raises(ValueError, match=r"--steps 4 -> 2"):
        train_tiny(run)
    from hspec.training.report import read_history

    assert read_history(run)["config"]["steps"] == 4


def test_start_clears_what_a_killed_save_left(tmp_path, tiny_target, train_tiny, capsys):
    run = tmp_path / "run"
    train_tiny(run)
    # What `kill -9` during a save leaves: half-written temporary folders of a state step and of the drafter,
    # and a drafter that was moved aside for its replacement that never arrived.
    for stale in (run / ".state.tmp-k1ll3d", run / "state" / ".step-000000004.tmp-abc_12"):
        stale.mkdir()
        (stale / "drafter.safetensors").write_bytes(b"\0" * 64)
    (run / ".drafter.old-xyz").mkdir()
    (run / "drafter").rename(run / ".drafter.old-xyz" / "checkpoint")
    train_tiny(run)
    out = capsys.readouterr().out
    assert f"removed {run / '.state.tmp-k1ll3d'}" in out
    assert f"removed {run / 'state' / '.step-000000004.tmp-abc_12'}" in out
    assert f"restored {run / 'drafter'}" in out
    assert not [p for p in (*run.iterdir(), *(run / "state").iterdir()) if p.name.startswith(".")]
    load_drafter(run / "drafter", tiny_target.model)


def test_resume_after_a_kill_tore_the_last_line_of_the_history(tmp_path, train_tiny):
    """A kill during an append leaves a torn last line: the resume drops it with a warning and goes on."""
    run = tmp_path / "run"
    train_tiny(run)
    with (run / "history.jsonl").open("a") as f:
        f.write('{"event": "step", "step": 2, "loss": 0.')
    with pytest.warns(UserWarning, match="its last line is torn"):
        train_tiny(run, override=True, steps=3)
    records = [json.loads(line) for line in (run / "history.jsonl").read_text().split("\n") if line]
    assert records[0]["event"] == "config"
    assert [r["step"] for r in records if r["event"] == "step"][-1] == 2  # step 3 of 3, logged whole


def test_resume_of_a_run_recorded_before_settings_were(tmp_path, train_tiny):
    """An older history has only the flat config record: its recipe is compared, its measured values not."""
    run = tmp_path / "run"
    train_tiny(run)
    lines = (run / "history.jsonl").read_text().split("\n")
    config = json.loads(lines[0])
    del config["settings"]
    (run / "history.jsonl").write_text("\n".join([json.dumps(config), *lines[1:]]))
    train_tiny(run)  # val_sequences (measured) and draft_vocab_size (20 either way) are not compared
    with pytest.raises(ValueError, match=r"changed: --steps 2 -> 3\."):
        train_tiny(run, steps=3)


def test_a_signal_stops_after_the_step_with_its_state_saved_and_the_rerun_resumes(tmp_path, train_tiny, capsys):
    import os
    import signal

    run = tmp_path / "run"

    def sigterm_during_step_3(steps_done):  # of 5, after the periodic save at step 2
        if steps_done == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        train_tiny(run, steps=5, on_step=sigterm_during_step_3)
    assert stopped.value.code == 128 + signal.SIGTERM
    printed = capsys.readouterr()
    assert "stopped after step 3 with its state saved" in printed.out + printed.err
    assert sorted(p.name for p in (run / "state").iterdir())[-1] == "step-000000003"
    assert not (run / "drafter").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is handed back
    train_tiny(run, steps=5)
    assert "resuming hspec at step 3/5" in capsys.readouterr().out
    assert (run / "drafter" / "config.json").exists()


def _save_watcher(state: Path, saved: list[int]):
    """An `on_step` hook noting the step of each training state saved under `state`: a step's update comes
    before its save, so a save is seen at the next step (the last one's by calling the hook once more)."""
    from hspec.training.checkpoint import training_states

    def note(steps_done: int) -> None:
        latest = training_states(state)[-1:]
        if latest and int(latest[0].name.removeprefix("step-")) not in saved:
            saved.append(int(latest[0].name.removeprefix("step-")))

    return note


def test_the_state_is_also_saved_once_the_save_interval_has_passed(tmp_path, tiny_target, feature_dir):
    """Between validations the state is saved when `save_minutes` have passed (a machine lost without a
    signal then costs at most that much), and not otherwise."""
    config = TrainConfig(steps=4, seqs_per_step=2, anchors_per_seq=2)
    for minutes, expected in ((0.0, [1, 2, 3, 4]), (60.0, [4])):
        saved_steps: list[int] = []
        watch = _save_watcher(tmp_path / f"run{minutes}" / "state", saved_steps)
        train_run.train("hspec", "tiny", [feature_dir], tmp_path / f"run{minutes}", config, val_every=100,
                        draft_vocab_size=20, target=tiny_target, save_minutes=minutes, on_step=watch)
        watch(config.steps)
        assert saved_steps == expected
    with pytest.raises(ValueError, match="save_minutes must be >= 0, got -1"):
        train_run.train("hspec", "tiny", [feature_dir], tmp_path / "bad", config, target=tiny_target, save_minutes=-1)


def test_drafter_options_set_a_fresh_drafters_config_and_are_recorded(tmp_path, tiny_target, feature_dir):
    from hspec.drafters.base import parse_config_options

    options = parse_config_options("dflash2", ["selector_trains_backbone=false", "selector_rank=8"])
    assert options == {"selector_trains_backbone": False, "selector_rank": 8}
    config = TrainConfig(steps=1, seqs_per_step=2, anchors_per_seq=2)
    saved = train_run.train("dflash2", "tiny", [feature_dir], tmp_path / "run", config, val_every=1,
                            draft_vocab_size=20, target=tiny_target, drafter_options=options)
    drafter = load_drafter(saved, tiny_target.model)
    assert drafter.config.selector_trains_backbone is False and drafter.config.selector_rank == 8
    first = json.loads((tmp_path / "run" / "history.jsonl").read_text().split("\n")[0])
    assert first["settings"]["drafter_options"] == {"selector_trains_backbone": False, "selector_rank": 8}
    with pytest.raises(ValueError, match="keeps the saved drafter's own"):
        train_run.train("dflash2", "tiny", [feature_dir], tmp_path / "again", config, init_from=saved,
                        target=tiny_target, drafter_options=options)


@pytest.mark.parametrize(("option", "message"), [
    ("selector_trains_backbone=maybe", "takes true or false"),
    ("selector_rank=wide", "takes an integer"),
    ("no_such_field=1", "selector_trains_backbone"),  # the allowed keys are listed
    ("selector_rank", "expected KEY=VALUE"),
])
def test_a_bad_drafter_option_names_itself_and_what_is_allowed(option, message):
    from hspec.drafters.base import parse_config_options

    with pytest.raises(ValueError, match=message):
        parse_config_options("dflash2", [option])
    with pytest.raises(ValueError, match="no trained configuration"):
        parse_config_options("ngram", ["k=1"])
