"""Shared fixtures: tiny random-config targets of each family, built locally (no downloads), the features
and runs the training tests share, and the live server the serving tests share."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hspec.models.loading import Target, load_target

FAMILIES = ("llama", "llama3-scaled", "qwen2", "qwen3", "mistral", "smollm2-like")


def hf_config(family: str, vocab_size: int = 96, max_positions: int = 512):
    """A tiny transformers config of `family` (random weights come from the model's own init)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        return LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "llama3-scaled":
        return LlamaConfig(**common, rope_theta=500000.0, tie_word_embeddings=False,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "smollm2-like":
        return LlamaConfig(**{**common, "num_attention_heads": 6, "hidden_size": 96}, head_dim=16,
                           rope_theta=100000.0, tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=False)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=24, rope_theta=1000000.0, tie_word_embeddings=True)
    if family == "mistral":
        return MistralConfig(**common, rope_theta=10000.0, sliding_window=None, tie_word_embeddings=False)
    raise ValueError(family)


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """The module scripts/NAME.py, imported by path (scripts/ is no package), with scripts/ importable while
    it loads so that a script may import its siblings."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def build_tiny_checkpoint(directory: Path, family: str, seed: int = 0, vocab_size: int = 96,
                          max_positions: int = 512) -> Path:
    """Save a randomly initialised HF model of `family` as config.json + model.safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, vocab_size, max_positions))
    # Random init gives near-uniform next-token distributions; larger output weights make them peaked,
    # like a trained model's, so greedy ties are vanishingly unlikely and acceptance is exercised.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


class _ByteTokenizer:
    """A stand-in tokenizer for tiny targets: one token per character code modulo the vocabulary."""

    def __init__(self, vocab_size: int, eos: int = 2) -> None:
        self.vocab_size, self.eos_token_ids = vocab_size, (eos,)

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        return [1] + [3 + ord(c) % (self.vocab_size - 3) for c in prompt]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + (i % 26)) for i in ids)


def pool_free_draft_batch(histories: list[list[int]]):
    """A greedy DraftBatch over `histories` with seq ids 10, 11, ... and no KV pool, for drafters that
    read only token histories (test stand-ins and the routing around them)."""
    from hspec.drafters.base import DraftBatch
    from hspec.sampling import SamplingBatch, SamplingParams

    b = len(histories)
    return DraftBatch(seq_ids=list(range(10, 10 + b)), anchor_tokens=torch.tensor([h[-1] for h in histories]),
                      tokens=histories, pool=None,  # type: ignore[arg-type]
                      sampling=SamplingBatch.from_params([SamplingParams()] * b),
                      generators=[torch.Generator() for _ in range(b)])


def assert_samples_follow(samples, exact: dict[tuple, float], min_p_value: float = 1e-4) -> None:
    """Chi-square goodness of fit of sampled continuations (tuples) to their exact probabilities.

    Cells with expected count < 5 are pooled into one. Fails when p < `min_p_value`, so a correct sampler
    fails with that probability per call; callers fix their seeds and never rerun.
    """
    n = len(samples)
    counts: dict[tuple, int] = {}
    for cell in samples:
        counts[cell] = counts.get(cell, 0) + 1
    assert set(counts) <= set(exact), "sampled a continuation the target gives zero probability"
    observed, expected, pooled_o, pooled_e = [], [], 0.0, 0.0
    for cell, prob in exact.items():
        if prob * n >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(prob * n)
        else:
            pooled_o += counts.get(cell, 0)
            pooled_e += prob * n
    observed.append(pooled_o)
    expected.append(pooled_e)
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    chi2 = float(((o - e) ** 2 / e).sum())
    dof = len(observed) - 1
    p_value = 1 - float(torch.distributions.Chi2(torch.tensor(float(dof))).cdf(torch.tensor(chi2)))
    assert p_value > min_p_value, f"chi2={chi2:.1f}, dof={dof}, p={p_value:.2e}"


def exact_joint(target, prompt, params, n_tokens):
    """P(first n_tokens tokens) under the target alone, by enumerating every continuation, computed as
    plain decoding computes it: the prompt prefilled (`TargetModel.prefill`, whose products may round otherwise
    than a decode's: w4a8's prefill multiplies bf16 rows), then each prefix's tokens in one forward."""
    from hspec.sampling import SamplingBatch

    sampling = SamplingBatch.from_params([params])
    V = target.config.vocab_size
    probs = {(): 1.0}
    for _ in range(n_tokens):
        new = {}
        prefixes = list(probs)
        pool = target.model.new_pool(num_pages=len(prefixes) * 4, page_size=8)
        sequences = list(range(len(prefixes)))
        for i in sequences:
            pool.add_sequence(i)
        with torch.no_grad():
            logits = target.model.prefill(torch.tensor([prompt] * len(prefixes)), pool, sequences,
                                          last_logits_only=True).logits
            if prefixes[0]:
                logits = target.model(torch.tensor([list(p) for p in prefixes]), pool, sequences,
                                      last_logits_only=True).logits
        dist = sampling.select([0] * len(prefixes)).probs(logits)[:, -1].double()
        for i, prefix in enumerate(prefixes):
            for t in range(V):
                if dist[i, t] > 0:
                    new[prefix + (t,)] = probs[prefix] * float(dist[i, t])
        probs = new
    return probs


def load_tiny(directory: Path, device: str = "cpu", dtype: torch.dtype | str = torch.float32,
              native: bool = True, kernels: bool = True) -> Target:
    """Load a tiny checkpoint through the real loader, without a HF tokenizer. `dtype` may also be
    a `--dtype` name, "int8" included; `native` and `kernels` as in `build_model`. --dtype w4a8 skips the
    test where hspec's CPU kernels do not run (it has no other kernels)."""
    from hspec.models import loading

    skip_without_kernels(dtype)

    config = loading.read_config(directory)
    model = loading.build_model(config, loading.read_state_dict(directory), dtype, device, native,
                                kernels)
    return Target(directory.name, directory, config, model, _ByteTokenizer(config.vocab_size))  # type: ignore[arg-type]


def skip_without_kernels(dtype: torch.dtype | str) -> None:
    """Skip the calling test for a dtype only hspec's CPU kernels compute (w4a8) where they do not run."""
    from hspec.models.dtype import KERNEL_ONLY_DTYPES
    from hspec.models.native import load_kernels

    if dtype in KERNEL_ONLY_DTYPES and not load_kernels():
        pytest.skip(f"--dtype {dtype} needs hspec's CPU kernels (x86-64 with AVX2 and FMA, a C++ compiler)")


@pytest.fixture(scope="session", autouse=True)
def _single_thread():
    """Tiny models run faster on one thread than fighting over two cores (and CI shares the machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _no_project_function_replaced(monkeypatch):
    """A test that replaced one of hspec's functions or methods fails: give the code a seam instead
    (tests/project_patches.py)."""
    from project_patches import replaced_project_functions

    yield
    replaced = replaced_project_functions(monkeypatch._setattr)
    assert not replaced, f"the test replaced hspec's own {', '.join(replaced)}; pass it in through a seam"


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_targets")
    return {f: build_tiny_checkpoint(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="session")
def vocab8_dir(tiny_dirs) -> Path:
    """A tiny Llama-family target with an 8-token vocabulary, small enough to enumerate every 3-token
    continuation (the sampled-distribution tests)."""
    return build_tiny_checkpoint(tiny_dirs["llama"].parent / "tiny_vocab8", "llama", seed=5, vocab_size=8)


@pytest.fixture(scope="session")
def tiny_target(tiny_dirs) -> Target:
    """The default tiny target (Llama family) for decoding tests."""
    return load_tiny(tiny_dirs["llama"])


@pytest.fixture(scope="session")
def native_propose_extension():
    """The native proposal's extension (drafters/hspec/native.py), built once; skips where it cannot be built."""
    from hspec.drafters.hspec.native import build_native_propose

    built = build_native_propose()
    if built is None:
        pytest.skip("the native proposal could not be built here (a C++ compiler and ninja are needed)")
    return built


@pytest.fixture(scope="session")
def smollm2() -> Target:
    """The real embedded default target (slow tests only)."""
    return load_target("smollm2")


def random_sequence_features(target: Target) -> list:
    """Features of 4 random sequences (40, 55, 33 and 60 tokens, prompts of 10) run through `target`: what
    the training tests train on (seed 0)."""
    from hspec.drafters.common import kv_layer_of, select_target_layers
    from hspec.training.features import compute_features

    g = torch.Generator().manual_seed(0)
    layers = select_target_layers(target.config.num_layers)
    kv_layers = [kv_layer_of(x) for x in layers]
    return [compute_features(target.model, torch.randint(3, target.config.vocab_size, (n,), generator=g).tolist(),
                             10, layers, kv_layers) for n in (40, 55, 33, 60)]


@pytest.fixture(scope="module")
def features(tiny_target) -> list:
    """`random_sequence_features` of the tiny target, once per module (test_dels.py and test_specblock.py
    draw their own)."""
    return random_sequence_features(tiny_target)


@pytest.fixture()
def feature_dir(tmp_path, tiny_target) -> Path:
    """A feature cache of 6 random sequences of the tiny target (ids seq/0..seq/5), as `hspec data features`
    writes it."""
    from hspec.drafters.common import kv_layer_of, select_target_layers
    from hspec.training.store import FeatureStore

    g = torch.Generator().manual_seed(3)
    V = tiny_target.config.vocab_size
    records = [{"id": f"seq/{i}", "prompt_ids": torch.randint(3, V, (8,), generator=g).tolist(),
                "response_ids": torch.randint(3, V // 2, (30,), generator=g).tolist()} for i in range(6)]
    layers = select_target_layers(tiny_target.config.num_layers)
    FeatureStore.build(tmp_path / "features", tiny_target.model, "tiny", records, layers,
                       [kv_layer_of(x) for x in layers])
    return tmp_path / "features"


@pytest.fixture()
def train_tiny(tiny_target, feature_dir):
    """`train_tiny(run_dir, override=False, cpu_flags=None, on_step=None, **recipe)`: `hspec train --drafter
    hspec` of the tiny target on `feature_dir` (2 steps of 2 sequences x 2 anchors, Vp 20, unless `recipe` says
    otherwise) on a CPU with `cpu_flags` (default: this one's), calling `on_step`; the saved drafter's directory."""
    from hspec.training.run import train
    from hspec.training.trainer import TrainConfig

    def run(run_dir: Path, override: bool = False, cpu_flags=None, on_step=None, **recipe) -> Path:
        config = TrainConfig(**{"steps": 2, "seqs_per_step": 2, "anchors_per_seq": 2, **recipe})
        return train("hspec", "tiny", [feature_dir], run_dir, config, val_every=2, draft_vocab_size=20,
                     override=override, target=tiny_target, cpu_flags=cpu_flags, on_step=on_step)

    return run


@pytest.fixture(scope="module")
def chat_target(tiny_dirs) -> Target:
    """The tiny Llama target with the serving tests' chat stand-in tokenizer, loaded once per module (so a
    module may change it). A module may override it: test_server_hostile.py's never emits EOS."""
    from serving_helpers import ChatByteTokenizer

    target = load_tiny(tiny_dirs["llama"])
    target.tokenizer = ChatByteTokenizer(target.config.vocab_size)
    return target


@pytest.fixture(scope="module")
def server(chat_target):
    """A live server of `chat_target` on loopback: n-gram drafts over 512 KV pages of 8."""
    from serving_helpers import start_server

    with start_server(chat_target, "ngram", num_pages=512) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    """The official `openai` client of `server` (no retries)."""
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def byte_chat_target(tiny_dirs) -> Target:
    """The tiny Llama with scripts/hardening_server.py's byte tokenizer, whose EOS it never emits: every request
    runs to its max_tokens (the server's fault and guard tests)."""
    target = load_tiny(tiny_dirs["llama"])
    target.tokenizer = load_script("hardening_server").ByteChatTokenizer(target.config.vocab_size)
    return target
