"""Drafter checkpoints (Speculators format) and trainer state, for every registered trained kind.

Round trip: identical tensors, the pruned vocabulary preserved, identical proposals (tokens and draft
distributions) in a sampled generate run. Only the drafter's own tensors are saved. A wrong target, a
missing or corrupt file fail with a message naming it. A save that fails midway leaves the previous
checkpoint intact. Trainer state restores the optimizer exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hspec import durable
from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters import DRAFTERS, checkpoint, create_drafter
from hspec.drafters.checkpoint import (
    CONFIG_FILE,
    DRAFTER_CONFIG_KEY,
    WEIGHTS_FILE,
    load_drafter,
    read_checkpoint,
    save_drafter,
)
from hspec.drafters.common import NeuralDrafter
from hspec.drafters.wrapping import WrappingDrafter
from hspec.sampling import SamplingParams
from hspec.training import checkpoint as trainer_checkpoint
from hspec.training.checkpoint import load_training_state, save_training_state, training_states

NEURAL_KINDS = [k for k in DRAFTERS.names() if issubclass(DRAFTERS.get(k), NeuralDrafter)]
DRAFT_VOCAB = 48  # < V = 96 of the tiny targets, so the pruned-vocabulary ids matter
VERIFIER = "tiny/llama"


def random_drafter(kind: str, target, seed: int = 0) -> NeuralDrafter:
    """A drafter of `kind` with random (not init-default) weights and a random pruned vocabulary."""
    torch.manual_seed(seed)
    cls = DRAFTERS.get(kind)
    config = cls.config_class.from_target(kind, target.config, draft_vocab_size=DRAFT_VOCAB)
    # The class directly: create_drafter's second parameter is already named `config` (the target's).
    drafter = cls(target.config, target_model=target.model, config=config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():  # e.g. the Markov head's W2 starts at zero: make every tensor count
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    drafter.head.set_vocab(torch.randperm(target.config.vocab_size, generator=g)[:DRAFT_VOCAB])
    return drafter


class _Recording(WrappingDrafter):
    """`model` as the decoding step sees it (its chains or its trees), keeping every proposal it made: the
    tokens and the distributions they were drawn from."""

    def __init__(self, model: NeuralDrafter) -> None:
        super().__init__(model)
        self.kind = model.kind
        self.proposes_tree = model.proposes_tree
        self.proposals: list[tuple[torch.Tensor, torch.Tensor]] = []

    def draft_positions(self, K: int) -> int:
        return self.model.draft_positions(K)

    def propose(self, batch, K):
        proposal = self.model.propose(batch, K)
        self.proposals.append((proposal.draft_tokens.clone(), proposal.draft_probs.clone()))
        return proposal

    def propose_tree(self, batch, K):
        draft = self.model.propose_tree(batch, K)  # a TreeDraft: its node tokens and their children's distributions
        self.proposals.append((draft.tokens.clone(), draft.draft_probs.clone()))
        return draft


def recorded_proposals(target, drafter: NeuralDrafter, K: int) -> tuple[list, list]:
    """Sampled speculative generation: every proposal (tokens, draft probs) and the output tokens."""
    recording = _Recording(drafter)
    prompts = [target.tokenizer.encode_prompt(p) for p in ("hello world", "abcabcabc")]
    decoder = SpeculativeDecoder(target.model, recording, K, target.tokenizer.eos_token_ids)
    out = decoder.generate(prompts, SamplingParams(temperature=1.0), 12, seeds=[5, 6])
    return recording.proposals, [s.token_ids for s in out.sequences]


def assert_same_state(a: NeuralDrafter, b: NeuralDrafter) -> None:
    sa, sb = a.drafter_state_dict(), b.drafter_state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


# ---- drafter checkpoints -------------------------------------------------------------------------------


def test_every_trained_kind_is_covered():
    assert "hspec" in NEURAL_KINDS
    assert "none" not in NEURAL_KINDS and "ngram" not in NEURAL_KINDS


@pytest.mark.parametrize("kind", NEURAL_KINDS)
def test_round_trip(tiny_target, tmp_path, kind):
    drafter = random_drafter(kind, tiny_target)
    save_drafter(drafter, tmp_path / "ckpt", VERIFIER, ["LlamaForCausalLM"])
    loaded = load_drafter(tmp_path / "ckpt", tiny_target.model)

    assert type(loaded) is type(drafter) and loaded.config == drafter.config
    assert_same_state(drafter, loaded)
    assert torch.equal(loaded.head.draft_vocab_ids, drafter.head.draft_vocab_ids)
    K = min(5, drafter.config.max_draft_len)
    before, tokens_before = recorded_proposals(tiny_target, drafter, K)
    after, tokens_after = recorded_proposals(tiny_target, loaded, K)
    assert tokens_before == tokens_after and len(before) == len(after) > 0
    for (t0, p0), (t1, p1) in zip(before, after):
        assert torch.equal(t0, t1) and torch.equal(p0, p1)
    # Drafts come only from the pruned vocabulary.
    drafted = torch.cat([t.flatten() for t, _ in before])
    assert bool(torch.isin(drafted, drafter.head.draft_vocab_ids).all())


@pytest.mark.parametrize("kind", NEURAL_KINDS)
def test_config_json_layout(tiny_target, tmp_path, kind):
    drafter = random_drafter(kind, tiny_target)
    save_drafter(drafter, tmp_path / "ckpt", VERIFIER, ["LlamaForCausalLM"])
    raw = json.loads((tmp_path / "ckpt" / CONFIG_FILE).read_text())
    c = drafter.config
    assert raw["speculators_model_type"] == kind
    assert raw["speculators_version"]
    spec = raw["speculators_config"]
    assert spec["algorithm"] == kind
    assert spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": c.max_draft_len,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": VERIFIER, "architectures": ["LlamaForCausalLM"]}
    layer = raw["transformer_layer_config"]
    assert (layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == (
        c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim)
    assert layer["vocab_size"] == c.vocab_size and layer["num_hidden_layers"] >= 1
    assert raw["draft_vocab_size"] == DRAFT_VOCAB and raw["block_size"] == c.max_draft_len
    assert raw["aux_hidden_state_layer_ids"] == list(c.target_layers)
    assert raw[DRAFTER_CONFIG_KEY]["kind"] == kind
    assert read_checkpoint(tmp_path / "ckpt").drafter_config == c


@pytest.mark.parametrize("kind", NEURAL_KINDS)
def test_only_drafter_weights_are_saved(tiny_target, tmp_path, kind):
    drafter = random_drafter(kind, tiny_target)
    save_drafter(drafter, tmp_path / "ckpt", VERIFIER)
    saved = load_file(str(tmp_path / "ckpt" / WEIGHTS_FILE))
    assert saved.keys() == drafter.drafter_state_dict().keys()
    assert not [k for k in saved if "embed_tokens" in k or "lm_head" in k]
    V, H = tiny_target.config.vocab_size, tiny_target.config.hidden_size
    embed, head = tiny_target.model.embed_tokens.weight, tiny_target.model.lm_head.weight
    for name, tensor in saved.items():
        if tensor.shape == (V, H):  # same shape as the target's matrices: must not be them
            assert not torch.equal(tensor, embed) and not torch.equal(tensor, head), name
    expected = sum(t.numel() for t in drafter.drafter_state_dict().values())
    assert sum(t.numel() for t in saved.values()) == expected


def test_default_verifier_architecture_is_the_targets(tiny_target, tmp_path):
    save_drafter(random_drafter("hspec", tiny_target), tmp_path / "ckpt", VERIFIER)
    info = read_checkpoint(tmp_path / "ckpt")
    assert info.verifier_architectures == (tiny_target.config.architecture,)
    assert info.verifier_name_or_path == VERIFIER


def test_version_is_recorded_even_when_hspec_is_not_installed(tiny_target, tmp_path, monkeypatch):
    def not_installed(name):
        raise checkpoint.PackageNotFoundError(name)

    monkeypatch.setattr(checkpoint, "version", not_installed)  # as when run with PYTHONPATH=src
    save_drafter(random_drafter("hspec", tiny_target), tmp_path / "ckpt", VERIFIER)
    recorded = json.loads((tmp_path / "ckpt" / CONFIG_FILE).read_text())["hspec_version"]
    pyproject = (Path(checkpoint.__file__).resolve().parents[3] / "pyproject.toml").read_text()
    assert recorded is not None and f'version = "{recorded}"' in pyproject


def test_model_free_kinds_have_no_checkpoint(tiny_target, tmp_path):
    with pytest.raises(TypeError, match="ngram"):
        save_drafter(create_drafter("ngram", tiny_target.config), tmp_path / "x", VERIFIER)


def _tiny(tmp_path: Path, family: str, vocab_size: int = 96):
    from conftest import build_tiny_checkpoint, load_tiny

    return load_tiny(build_tiny_checkpoint(tmp_path / f"{family}-{vocab_size}", family, vocab_size=vocab_size))


@pytest.mark.parametrize("family,vocab_size,named", [("llama", 128, "V (vocab_size): 96 vs 128"),
                                                     ("qwen3", 96, "D (head_dim): 16 vs 24"),
                                                     ("smollm2-like", 96, "H (hidden_size): 64 vs 96")])
def test_mismatched_target_fails_clearly(tiny_target, tmp_path, family, vocab_size, named):
    path = save_drafter(random_drafter("hspec", tiny_target), tmp_path / "ckpt", VERIFIER)
    other = _tiny(tmp_path, family, vocab_size)
    with pytest.raises(ValueError) as err:
        load_drafter(path, other.model)
    message = str(err.value)
    assert named in message and str(path) in message and VERIFIER in message
    assert other.config.architecture in message


def test_missing_and_corrupt_files_are_named(tiny_target, tmp_path):
    path = save_drafter(random_drafter("hspec", tiny_target), tmp_path / "ckpt", VERIFIER)
    weights, config = path / WEIGHTS_FILE, path / CONFIG_FILE

    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=str(weights)):
        load_drafter(path, tiny_target.model)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=str(weights)):
        load_drafter(path, tiny_target.model)

    raw = json.loads(config.read_text())
    config.write_text("{not json")
    with pytest.raises(ValueError, match=str(config)):
        load_drafter(path, tiny_target.model)
    config.write_text(json.dumps({**raw, "speculators_model_type": "no-such-kind"}))
    with pytest.raises(ValueError, match="no-such-kind"):
        load_drafter(path, tiny_target.model)
    config.write_text(json.dumps({k: v for k, v in raw.items() if k != DRAFTER_CONFIG_KEY}))
    with pytest.raises(ValueError, match=DRAFTER_CONFIG_KEY):
        load_drafter(path, tiny_target.model)
    config.unlink()
    with pytest.raises(FileNotFoundError, match=str(config)):
        load_drafter(path, tiny_target.model)


def test_weights_of_another_shape_are_refused(tiny_target, tmp_path):
    """A config.json and a model.safetensors that disagree (e.g. files mixed up) fail strictly."""
    a = save_drafter(random_drafter("hspec", tiny_target), tmp_path / "a", VERIFIER)
    other_kind = next((k for k in NEURAL_KINDS if k != "hspec"), None)
    if other_kind is None:
        pytest.skip("needs a second trained kind")
    b = save_drafter(random_drafter(other_kind, tiny_target), tmp_path / "b", VERIFIER)
    (a / WEIGHTS_FILE).write_bytes((b / WEIGHTS_FILE).read_bytes())
    with pytest.raises(ValueError, match=f"{a / WEIGHTS_FILE} does not match"):
        load_drafter(a, tiny_target.model)


def test_failed_save_keeps_the_previous_checkpoint(tiny_target, tmp_path, monkeypatch):
    first = random_drafter("hspec", tiny_target, seed=0)
    path = save_drafter(first, tmp_path / "ckpt", VERIFIER)
    config_before = (path / CONFIG_FILE).read_bytes()

    def half_written(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # a partial file, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_file", half_written)
    second = random_drafter("hspec", tiny_target, seed=1)
    with pytest.raises(KeyboardInterrupt):
        save_drafter(second, path, VERIFIER)
    monkeypatch.undo()

    assert (path / CONFIG_FILE).read_bytes() == config_before
    assert_same_state(first, load_drafter(path, tiny_target.model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory left behind


def test_failed_swap_puts_the_previous_checkpoint_back(tiny_target, tmp_path, monkeypatch):
    """The replace of an existing checkpoint fails after the old one was moved aside: it is restored."""
    first = random_drafter("hspec", tiny_target, seed=0)
    path = save_drafter(first, tmp_path / "ckpt", VERIFIER)
    real_rename = durable.os.rename

    def rename(src, dst):
        if Path(dst) == path and ".tmp-" in Path(src).name:  # moving the new checkpoint in
            raise OSError("disk gone")
        real_rename(src, dst)

    monkeypatch.setattr(durable.os, "rename", rename)
    with pytest.raises(OSError, match="disk gone"):
        save_drafter(random_drafter("hspec", tiny_target, seed=1), path, VERIFIER)
    monkeypatch.undo()
    assert_same_state(first, load_drafter(path, tiny_target.model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_overwrite_replaces_the_checkpoint(tiny_target, tmp_path):
    path = save_drafter(random_drafter("hspec", tiny_target, seed=0), tmp_path / "ckpt", VERIFIER)
    second = random_drafter("hspec", tiny_target, seed=1)
    save_drafter(second, path, VERIFIER)
    assert_same_state(second, load_drafter(path, tiny_target.model))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_save_never_replaces_something_else(tiny_target, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "history.jsonl").write_text("{}")
    with pytest.raises(FileExistsError, match="not a drafter checkpoint"):
        save_drafter(random_drafter("hspec", tiny_target), tmp_path / "run", VERIFIER)
    assert (tmp_path / "run" / "history.jsonl").read_text() == "{}"


def test_interrupted_swap_names_the_previous_checkpoint(tiny_target, tmp_path):
    """A process killed between the two renames of an overwrite: the loader says where the old one is."""
    path = save_drafter(random_drafter("hspec", tiny_target), tmp_path / "ckpt", VERIFIER)
    aside = tmp_path / ".ckpt.old-abc"
    aside.mkdir()
    path.rename(aside / "checkpoint")
    with pytest.raises(FileNotFoundError, match=str(aside / "checkpoint")):
        load_drafter(path, tiny_target.model)


# ---- trainer state ------------------------------------------------------------------------------------


def _optimizer(drafter: NeuralDrafter) -> torch.optim.Optimizer:
    return torch.optim.AdamW(drafter.parameters(), lr=1e-3, weight_decay=0.01)


def _train(drafter: NeuralDrafter, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    """A few optimizer steps on a simple loss over every trainable tensor."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = sum(((p - torch.randn(p.shape, generator=g)) ** 2).mean() for p in drafter.parameters())
        loss.backward()
        optimizer.step()


def _assert_same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for name, value in sa["state"][i].items():
            other = sb["state"][i][name]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (i, name)


@pytest.mark.parametrize("kind", NEURAL_KINDS)
def test_training_state_round_trip(tiny_target, tmp_path, kind):
    drafter = random_drafter(kind, tiny_target, seed=0)
    optimizer = _optimizer(drafter)
    _train(drafter, optimizer, 2, seed=0)
    rng = torch.Generator().manual_seed(123)
    extra = {"rng": rng.get_state(), "epoch": 1, "note": "x", "history": [0.5, 0.25]}
    save_training_state(tmp_path / "state", drafter, optimizer, 2, extra)

    resumed = random_drafter(kind, tiny_target, seed=9)  # different weights and vocabulary
    resumed_opt = _optimizer(resumed)
    step, got = load_training_state(tmp_path / "state", resumed, resumed_opt)
    assert step == 2
    assert torch.equal(got["rng"], extra["rng"]) and got["epoch"] == 1 and got["history"] == [0.5, 0.25]
    assert_same_state(drafter, resumed)
    _assert_same_optimizer_state(optimizer, resumed_opt)
    # Exact resume: the next steps agree bit for bit.
    _train(drafter, optimizer, 2, seed=1)
    _train(resumed, resumed_opt, 2, seed=1)
    assert_same_state(drafter, resumed)


def test_training_state_keeps_the_last_n(tiny_target, tmp_path):
    drafter = random_drafter("hspec", tiny_target)
    optimizer = _optimizer(drafter)
    state = tmp_path / "state"
    for step in (10, 20, 30, 40):
        save_training_state(state, drafter, optimizer, step, {"step": step}, keep_last=2)
    assert [p.name for p in training_states(state)] == ["step-000000030", "step-000000040"]
    assert load_training_state(state, drafter, optimizer) == (40, {"step": 40})
    assert load_training_state(state, drafter, optimizer, step=30) == (30, {"step": 30})
    save_training_state(state, drafter, optimizer, 50, {})  # keep_last=1 (default): only the latest
    assert [p.name for p in training_states(state)] == ["step-000000050"]
    assert not [p for p in state.iterdir() if p.name.startswith(".")]


def test_failed_first_training_save_leaves_nothing(tiny_target, tmp_path, monkeypatch):
    """`state/` exists only once it holds a complete step, so `exists()` is a safe resume test."""
    drafter = random_drafter("hspec", tiny_target)
    optimizer = _optimizer(drafter)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_checkpoint.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_training_state(tmp_path / "state", drafter, optimizer, 1, {})
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    save_training_state(tmp_path / "state", drafter, optimizer, 1, {})
    monkeypatch.setattr(trainer_checkpoint.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_training_state(tmp_path / "state", drafter, optimizer, 2, {})
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["step-000000001"]
    assert load_training_state(tmp_path / "state", drafter, optimizer)[0] == 1


def test_training_state_errors(tiny_target, tmp_path):
    drafter = random_drafter("hspec", tiny_target)
    optimizer = _optimizer(drafter)
    with pytest.raises(FileNotFoundError, match="no training state"):
        load_training_state(tmp_path / "state", drafter, optimizer)
    save_training_state(tmp_path / "state", drafter, optimizer, 3, {})
    with pytest.raises(FileNotFoundError, match="for step 4"):
        load_training_state(tmp_path / "state", drafter, optimizer, step=4)
    other_kind = next((k for k in NEURAL_KINDS if k != "hspec"), None)
    if other_kind is not None:
        other = random_drafter(other_kind, tiny_target)
        with pytest.raises(ValueError, match="is for drafter kind 'hspec'"):
            load_training_state(tmp_path / "state", other, _optimizer(other))


def test_stale_temporaries_are_cleared_and_a_moved_aside_checkpoint_comes_back(tiny_target, tmp_path):
    from hspec.durable import remove_stale_temporaries

    drafter = random_drafter("hspec", tiny_target)
    kept = save_drafter(drafter, tmp_path / "kept", VERIFIER)
    (tmp_path / ".kept.tmp-a1").mkdir()  # a save killed while writing
    (tmp_path / ".kept.old-b2" / "checkpoint").mkdir(parents=True)  # killed after the replace finished
    moved = save_drafter(drafter, tmp_path / "moved", VERIFIER)
    (tmp_path / ".moved.old-c3").mkdir()
    moved.rename(tmp_path / ".moved.old-c3" / "checkpoint")  # killed between the replace's two renames
    (tmp_path / ".hidden").mkdir()  # not ours: left alone
    done = remove_stale_temporaries(tmp_path)
    assert len(done) == 3 and f"restored {moved}" in done[2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "kept", "moved"]
    assert_same_state(drafter, load_drafter(moved, tiny_target.model))
    assert remove_stale_temporaries(tmp_path) == [] and remove_stale_temporaries(tmp_path / "none") == []
    assert kept.is_dir()


def test_a_checkpoints_digest_follows_its_weights_and_config_not_its_directory(tmp_path, tiny_target):
    import shutil

    from hspec.drafters.checkpoint import checkpoint_digest

    save_drafter(random_drafter("hspec", tiny_target), tmp_path / "a", VERIFIER)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    assert checkpoint_digest(tmp_path / "copy") == checkpoint_digest(tmp_path / "a")
    save_drafter(random_drafter("hspec", tiny_target, seed=1), tmp_path / "b", VERIFIER)
    assert checkpoint_digest(tmp_path / "b") != checkpoint_digest(tmp_path / "a")
    (tmp_path / "a" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        checkpoint_digest(tmp_path / "a")


def test_decoding_options_change_a_loaded_drafters_config_and_no_weight(tiny_target, tmp_path):
    """A decoding command's --drafter-option: the fields a config names in `decoding_options` are set on the
    saved config at load (SpecBlock's tree budget and costs), the weights stay the saved ones; any other
    field, or a kind without decoding options, is refused naming what is allowed."""
    from hspec.runtime import decoding_options_of

    drafter = random_drafter("specblock", tiny_target)
    save_drafter(drafter, tmp_path / "sb", VERIFIER, ["LlamaForCausalLM"])
    options = decoding_options_of(["specblock+ngram:0.4", "dflash"], ["adapt_tree=false", "node_budget=5"])
    assert options == {"specblock+ngram:0.4": {"adapt_tree": False, "node_budget": 5}, "dflash": {}}
    loaded = load_drafter(tmp_path / "sb", tiny_target.model, options=options["specblock+ngram:0.4"])
    assert loaded.config.node_budget == 5 and not loaded.config.adapt_tree
    assert loaded.config.rank_coverage == drafter.config.rank_coverage
    assert_same_state(drafter, loaded)
    with pytest.raises(ValueError, match=r"\['markov_rank'\] cannot be set on a trained specblock drafter; its "
                                         r"decoding options are \['adapt_tree', 'node_budget'"):
        load_drafter(tmp_path / "sb", tiny_target.model, options={"markov_rank": 0})
    with pytest.raises(ValueError, match=r"'node_budget=5': no drafter here takes it; .*'dflash': \[\]"):
        decoding_options_of(["dflash", "ngram"], ["node_budget=5"])
    with pytest.raises(ValueError, match="node_budget takes an integer"):
        decoding_options_of(["specblock"], ["node_budget=wide"])


# A child process: saves a fresh drafter's training state as step 2 into argv[2] (the target: argv[1]), allowed
# to write 4 KB to any file, so that the save dies partway (SIGXFSZ, as a kill would).
_KILLED_SAVE = """
import resource, signal, sys
from pathlib import Path
import torch
from hspec.drafters import create_drafter
from hspec.models.loading import build_model, read_config, read_state_dict
from hspec.training.checkpoint import save_training_state

config = read_config(Path(sys.argv[1]))
model = build_model(config, read_state_dict(Path(sys.argv[1])), torch.float32, "cpu", native=False)
torch.manual_seed(1)
drafter = create_drafter("hspec", config, target_model=model)
optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it (the write fails); die as a kill would
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
save_training_state(Path(sys.argv[2]), drafter, optimizer, 2, {})
"""


def test_a_kill_during_a_training_save_then_a_clean_resume(tiny_target, tiny_dirs, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    drafter = random_drafter("hspec", tiny_target)
    optimizer = _optimizer(drafter)
    state = tmp_path / "state"
    save_training_state(state, drafter, optimizer, 1, {"step": 1})
    src = Path(durable.__file__).resolve().parents[1]
    child = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tiny_dirs["llama"]), str(state)],
                           env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGXFSZ, child.stderr[-2000:]
    assert [p.name for p in training_states(state)] == ["step-000000001"]  # the half-written step is not one
    [leftover] = [p for p in state.iterdir() if p.name.startswith(".")]
    assert durable.remove_stale_temporaries(state) == [f"removed {leftover} (an interrupted save's incomplete "
                                                       "temporary folder)"]
    resumed = random_drafter("hspec", tiny_target, seed=3)
    assert load_training_state(state, resumed, _optimizer(resumed)) == (1, {"step": 1})
    assert_same_state(drafter, resumed)
