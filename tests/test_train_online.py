"""Training from generated corpora with features computed online, and on a chosen device.

`hspec train --corpus` must hold out the same sequences as training from the cached features of the
same corpus, and its features must be the target's own (the cache only rounds them). On a CUDA GPU
(tests marked gpu) training and greedy generation must agree with the CPU.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import load_tiny
from hspec.drafters.common import kv_layer_of, select_target_layers
from hspec.models.loading import resolve_device
from hspec.training import run as train_run
from hspec.training.features import OnlineFeatures, compute_features, compute_features_batch
from hspec.training.store import FeatureStore, FeatureStores
from hspec.training.trainer import TrainConfig


def _records(target, ids: list[str], seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    V = target.config.vocab_size
    return [{"id": rid, "prompt_ids": torch.randint(3, V, (6,), generator=g).tolist(),
             "response_ids": torch.randint(3, V // 2, (int(torch.randint(20, 40, (1,), generator=g)),),
                                           generator=g).tolist()} for rid in ids]


@pytest.fixture()
def corpora(tmp_path, tiny_target):
    """Two corpus files (ids out of order inside each, one record without a response), some held out."""
    held_out = [f"seq/{i}" for i in range(400) if train_run.is_validation(f"seq/{i}")]
    parts = [["seq/9", held_out[0], "seq/2", "seq/5"], [held_out[1], "seq/7", "seq/1"]]
    paths = []
    for n, ids in enumerate(parts):
        records = _records(tiny_target, ids, seed=n)
        records.append({"id": f"empty/{n}", "prompt_ids": [5, 6], "response_ids": []})
        path = tmp_path / f"corpus_{n}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        paths.append(path)
    return paths


def _layers(target):
    layers = select_target_layers(target.config.num_layers)
    return layers, [kv_layer_of(x) for x in layers]


def test_online_features_are_the_targets_and_ordered_like_the_cache(tmp_path, tiny_target, corpora):
    layers, kv_layers = _layers(tiny_target)
    online = OnlineFeatures(corpora, tiny_target.model, "tiny", layers, kv_layers)
    cached = FeatureStores([_cache(tiny_target, c, tmp_path / f"f{i}") for i, c in enumerate(corpora)])
    assert online.ids == cached.ids and online.lengths == cached.lengths
    assert online.available() == cached.available()
    assert train_run.held_out_ids(online, 24) == train_run.held_out_ids(cached, 24)
    assert len(train_run.held_out_ids(online, 24)) == 2
    for i in online.available():
        feats, stored = online.load(i), cached.load(i)
        assert torch.equal(online.tokens(i), cached.tokens(i)) and torch.equal(feats.tokens, stored.tokens)
        record = online.records[i]
        fresh = compute_features(tiny_target.model, record["prompt_ids"] + record["response_ids"],
                                 len(record["prompt_ids"]), layers, kv_layers)
        assert torch.equal(feats.hidden, fresh.hidden) and torch.equal(feats.final_hidden, fresh.final_hidden)
        assert feats.prompt_length == stored.prompt_length
        torch.testing.assert_close(feats.hidden, stored.hidden, rtol=1e-2, atol=1e-2)  # bf16 in the cache
        for layer in kv_layers:
            torch.testing.assert_close(feats.kv[layer][0], stored.kv[layer][0], rtol=2e-3, atol=2e-3)  # fp16


def test_a_steps_sequences_computed_in_one_forward_are_each_computed_alone(tiny_target, corpora):
    """`compute_features_batch` pads sequences of several lengths to the longest and cuts them back: what each
    gets equals its own forward to float32 rounding; `OnlineFeatures.load_many` returns them in the order asked,
    a sequence asked twice computed once."""
    layers, kv_layers = _layers(tiny_target)
    online = OnlineFeatures(corpora, tiny_target.model, "tiny", layers, kv_layers)
    records = online.records[:4]
    assert len({len(r["prompt_ids"] + r["response_ids"]) for r in records}) > 1
    batch = compute_features_batch(tiny_target.model, [(r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"]))
                                                       for r in records], layers, kv_layers)
    for record, feats in zip(records, batch):
        alone = compute_features(tiny_target.model, record["prompt_ids"] + record["response_ids"],
                                 len(record["prompt_ids"]), layers, kv_layers)
        assert torch.equal(feats.tokens, alone.tokens) and feats.prompt_length == alone.prompt_length
        for ours, theirs in [(feats.hidden, alone.hidden), (feats.final_hidden, alone.final_hidden),
                             *[(feats.kv[x][i], alone.kv[x][i]) for x in kv_layers for i in (0, 1)]]:
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    many = online.load_many([2, 0, 2])
    assert [f.tokens.shape[0] for f in many] == [online.lengths[2], online.lengths[0], online.lengths[2]]
    assert many[0] is many[2] and many[0].target_lse is not None  # one forward, the teacher's summary added
    torch.testing.assert_close(many[1].final_hidden, online.load(0).final_hidden, rtol=1e-5, atol=1e-5)


def _cache(target, corpus, out_dir):
    from hspec.training.datagen import read_corpus

    records = sorted((r for r in read_corpus(corpus) if r["response_ids"]), key=lambda r: r["id"])
    layers, kv_layers = _layers(target)
    FeatureStore.build(out_dir, target.model, "tiny", records, layers, kv_layers)
    return out_dir


def test_feature_cache_written_under_the_old_layer_key_still_loads_and_resumes(tmp_path, tiny_target, corpora):
    """Caches written before the rename name the layers "hidden_layers" in index.json: reading one and
    resuming its build both accept it, and the index is left as it was."""
    out = _cache(tiny_target, corpora[0], tmp_path / "f")
    index = out / "index.json"
    meta = json.loads(index.read_text())
    meta["hidden_layers"] = meta.pop("target_layers")
    index.write_text(json.dumps(meta))
    assert FeatureStore(out).target_layers == tuple(meta["hidden_layers"])
    _cache(tiny_target, corpora[0], out)
    assert json.loads(index.read_text()) == meta


def test_the_cache_stores_the_teacher_summary_and_adds_it_to_files_written_without_it(tmp_path, tiny_target,
                                                                                       corpora):
    """The stored summary is the one training would compute from the stored final hidden states, and a
    rebuild over a cache written before the summary existed adds it to every file, changing nothing else."""
    out = _cache(tiny_target, corpora[0], tmp_path / "f")
    store = FeatureStore(out)
    stored = [store.load(i) for i in store.available()]
    for feats in stored:
        assert feats.target_lse is not None and feats.target_lse.dtype == torch.float32
        bare = dataclasses.replace(feats, target_lse=None, target_argmax=None).with_teacher(tiny_target.model)
        assert torch.equal(bare.target_lse, feats.target_lse) and torch.equal(bare.target_argmax, feats.target_argmax)
    for i in store.available():  # rewrite every file as the old code wrote it
        with safe_open(str(store._path(i)), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if k not in ("target_lse", "target_argmax")}
            meta = f.metadata()
        save_file(tensors, str(store._path(i)), metadata=meta)
    assert not any(store.has_teacher_summary(i) for i in store.available())
    assert store.load(0).target_lse is None
    _cache(tiny_target, corpora[0], out)
    for i, feats in zip(store.available(), stored):
        again = store.load(i)
        assert store.has_teacher_summary(i)
        for name in ("tokens", "hidden", "final_hidden", "target_lse", "target_argmax"):
            assert torch.equal(getattr(again, name), getattr(feats, name)), name
        assert all(torch.equal(a, b) for layer in feats.kv for a, b in zip(again.kv[layer], feats.kv[layer]))


def test_online_features_refuse_a_missing_or_empty_corpus(tmp_path, tiny_target):
    layers, kv_layers = _layers(tiny_target)
    with pytest.raises(FileNotFoundError, match="no corpus at .*nothing.jsonl"):
        OnlineFeatures([tmp_path / "nothing.jsonl"], tiny_target.model, "tiny", layers, kv_layers)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"id": "a", "prompt_ids": [4], "response_ids": []}) + "\n")
    with pytest.raises(ValueError, match="empty.jsonl holds no response"):
        OnlineFeatures([empty], tiny_target.model, "tiny", layers, kv_layers)


def test_training_online_matches_training_from_the_cache_up_to_its_rounding(tmp_path, tiny_target, corpora):
    config = TrainConfig(steps=3, seqs_per_step=2, anchors_per_seq=4)
    caches = [_cache(tiny_target, c, tmp_path / f"f{i}") for i, c in enumerate(corpora)]
    torch.manual_seed(0)
    train_run.train("hspec", "tiny", caches, tmp_path / "cached", config, log_every=1, val_every=3, target=tiny_target)
    torch.manual_seed(0)
    saved = train_run.train("hspec", "tiny", [], tmp_path / "online", config, log_every=1, val_every=3,
                            corpora=corpora, target=tiny_target)
    logs = {}
    for name in ("cached", "online"):
        lines = [json.loads(x) for x in (tmp_path / name / "history.jsonl").read_text().split("\n") if x]
        logs[name] = lines
    assert logs["online"][0]["features"] == "online: " + ",".join(map(str, corpora))
    assert logs["online"][0]["device"] == "cpu"
    for key in ("train_sequences", "val_sequences", "train_tokens", "draft_vocab_coverage"):
        assert logs["online"][0][key] == logs["cached"][0][key]
    losses = {name: [r["loss"] for r in lines if r["event"] == "step"] for name, lines in logs.items()}
    assert len(losses["online"]) == 3
    assert losses["online"] == pytest.approx(losses["cached"], rel=2e-2)
    assert losses["online"] != losses["cached"]  # really another feature source (the cache rounds)
    assert (saved / "model.safetensors").exists()


def test_resolve_device_names_what_is_allowed(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu': use auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="unknown device 'cuda:x'"):
        resolve_device("cuda:x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="device 'cuda' asked for, but torch sees no CUDA GPU here"):
        resolve_device("cuda")


def test_the_process_group_follows_the_device_not_the_machine():
    assert train_run.process_group_backend(torch.device("cpu")) == "gloo"  # --device cpu on a GPU machine too
    assert train_run.process_group_backend(torch.device("cuda", 1)) == "nccl"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_training_on_the_gpu_follows_the_cpu(tmp_path, tiny_dirs, corpora):
    from hspec.drafters import create_drafter
    from hspec.drafters.checkpoint import save_drafter

    cpu_target = load_tiny(tiny_dirs["llama"])
    torch.manual_seed(0)
    start = save_drafter(create_drafter("hspec", cpu_target.config, target_model=cpu_target.model),
                         tmp_path / "start", verifier_name_or_path="tiny",
                         verifier_architectures=[cpu_target.config.architecture])
    losses = {}
    for device in ("cpu", "cuda"):
        target = load_tiny(tiny_dirs["llama"], device)
        # init_from: the same weights on both (a fresh drafter's init is per device)
        saved = train_run.train("hspec", "tiny", [], tmp_path / device, TrainConfig(steps=3, seqs_per_step=2,
                                anchors_per_seq=4), log_every=1, val_every=3, corpora=corpora, device=device,
                                init_from=start, target=target)
        lines = [json.loads(x) for x in (tmp_path / device / "history.jsonl").read_text().split("\n") if x]
        losses[device] = [r["loss"] for r in lines if r["event"] == "step"]
        assert lines[0]["device"].startswith(device) and (saved / "model.safetensors").exists()
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_greedy_generation_on_the_gpu_equals_the_cpu(tiny_dirs):
    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.drafters import create_drafter
    from hspec.sampling import SamplingParams

    prompts = [[5, 9, 14, 3], [7, 7, 21], [30, 2, 11, 19, 4]]
    outputs = {}
    for device in ("cpu", "cuda"):
        target = load_tiny(tiny_dirs["llama"], device)
        decoder = SpeculativeDecoder(target.model, create_drafter("none", target.config), 1, [2])
        out = decoder.generate(prompts, SamplingParams(), 12)
        outputs[device] = [s.token_ids for s in out.sequences]
    assert outputs["cuda"] == outputs["cpu"]
