"""Drafter checkpoints in the Speculators format: save, read, load and export (no trainer state).

A drafter checkpoint is a directory in the layout of vllm-project/speculators (docs/design.md#checkpoints):

    config.json         speculators_model_type (= the drafter kind), speculators_version, speculators_config
                        {algorithm, proposal_methods [greedy, speculative_tokens = K], default_proposal_method,
                        verifier {name_or_path, architectures}}, transformer_layer_config (the attention/MLP
                        dims, as a Qwen3 config), the Speculators names of our shared fields (draft_vocab_size,
                        block_size = max_draft_len, aux_hidden_state_layer_ids = target_layers, mask_token_id,
                        markov_rank, ...) and, under `hspec_drafter_config`, the full `DrafterConfig.to_dict()`:
                        the one source `load_drafter` rebuilds the drafter from.
    model.safetensors   the drafter's own tensors only (`drafter_state_dict()`: trainable weights and the
                        draft-vocabulary ids). The target's embedding and LM head are never saved: a drafter
                        shares them with its target at load.

The common part (`speculators_config`) validates with Speculators' own `SpeculatorsConfig`; see
results/speculators_compat.md for what its loader does with each of our kinds.

This module sits beside the drafters so that inference (runtime, serving, eval) loads a drafter without
importing the trainer; the trainer's own state (optimizer, step) is in `hspec.training.checkpoint`.
Every write goes to a hidden temporary directory in the same parent and is renamed into place
(`hspec.durable.atomic_directory`), so a killed save never leaves a half checkpoint where a loader would
read it; `hspec.durable.remove_stale_temporaries` clears what such a kill leaves behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from hspec.drafters.base import DRAFTERS
from hspec.drafters.common import DrafterConfig, NeuralDrafter
from hspec.durable import OLD_MARK, atomic_directory, check_replaceable
from hspec.models.config import TargetConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DRAFTER_CONFIG_KEY = "hspec_drafter_config"  # our full DrafterConfig inside the Speculators config.json
# The Speculators release whose config.json layout this writes (checked in results/speculators_compat.md).
SPECULATORS_FORMAT_VERSION = "0.9.0"
CHECKPOINT_WORDS = "a drafter checkpoint written by hspec"  # what a save may replace, in its refusal

# Target dimensions a drafter is tied to: its weights, the target layers it reads and the K/V it reuses.
_TARGET_DIMS = (("vocab_size", "V"), ("hidden_size", "H"), ("num_layers", "L"), ("num_heads", "Hq"),
                ("num_kv_heads", "Hkv"), ("head_dim", "D"))


# ---- the config.json ---------------------------------------------------------------------------------


def speculators_config(drafter: NeuralDrafter, verifier_name_or_path: str,
                       verifier_architectures: Sequence[str] | None = None) -> dict[str, Any]:
    """The `config.json` dict of `drafter` (module docstring), JSON-ready.

    verifier_architectures defaults to the target's HF class, e.g. ["LlamaForCausalLM"].
    """
    config = drafter.config
    architectures = list(verifier_architectures) if verifier_architectures else [config.target.architecture]
    return {
        "architectures": [type(drafter).__name__],
        "speculators_model_type": drafter.kind,
        "speculators_version": SPECULATORS_FORMAT_VERSION,
        "hspec_version": _package_version(),
        "speculators_config": {
            "algorithm": drafter.kind,
            # One chain of K drafts per step, verified by the target. `speculative_tokens` = K: every slot of
            # the block, the anchor's included, predicts a token (`sample_from_anchor` below).
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.max_draft_len,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": architectures},
        },
        "transformer_layer_config": transformer_layer_config(drafter),
        # Our fields under the names Speculators' DFlash/DSpark/P-Eagle configs give them. Informational:
        # `load_drafter` reads only DRAFTER_CONFIG_KEY.
        "draft_vocab_size": config.draft_vocab_size,
        "block_size": config.max_draft_len,  # Speculators' DFlash name for the trained draft length K
        "sample_from_anchor": True,  # slot 0 (the anchor x0) predicts x_{p+1} (docs/design.md#the-decoding-step)
        "target_hidden_size": config.hidden_size,
        # HF hidden-state indices (0 = embeddings), the convention Speculators uses for these ids.
        "aux_hidden_state_layer_ids": list(config.target_layers),
        "eagle_aux_hidden_state_layer_ids": list(config.target_layers),  # the EAGLE-3 / P-Eagle name
        "mask_token_id": config.mask_token_id,
        "markov_rank": config.markov_rank,
        "markov_head_type": "vanilla",  # first-order W2(W1[prev]) (DSpark's "vanilla")
        "enable_confidence_head": bool(getattr(config, "enable_confidence_head", False)),
        "embed_requires_grad": False,  # the target's embedding, frozen (P-Eagle's default is True)
        "dtype": str(_drafter_dtype(drafter)).removeprefix("torch."),
        DRAFTER_CONFIG_KEY: config.to_dict(),
    }


def transformer_layer_config(drafter: NeuralDrafter) -> dict[str, Any]:
    """The drafter layers' dimensions as a HF Qwen3 config dict (Speculators' `transformer_layer_config`).

    Every attention module of our drafters is Qwen3-style (q/k-norm, no bias) with the target's
    (Hq, Hkv, D) and RoPE; the MLPs have the target's I. Layers with other modules (H-Spec's Mamba-2)
    are described by DRAFTER_CONFIG_KEY; `num_hidden_layers` counts all drafter layers.
    """
    c = drafter.config
    target = c.target
    rope: dict[str, Any] = {"rope_type": target.rope_scaling.rope_type, "rope_theta": target.rope_theta}
    if target.rope_scaling.rope_type != "default":
        rope["factor"] = target.rope_scaling.factor
    if target.rope_scaling.rope_type == "llama3":
        rope.update(low_freq_factor=target.rope_scaling.low_freq_factor,
                    high_freq_factor=target.rope_scaling.high_freq_factor,
                    original_max_position_embeddings=target.rope_scaling.original_max_position_embeddings)
    return {
        "model_type": "qwen3",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": _num_hidden_layers(drafter),
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_parameters": rope,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def _num_hidden_layers(drafter: nn.Module) -> int:
    """Drafter layers: the length of its longest direct `nn.ModuleList` (every kind keeps its layers in one)."""
    lists = [len(m) for m in drafter.children() if isinstance(m, nn.ModuleList)]
    return max(lists, default=0)


def _drafter_dtype(drafter: nn.Module) -> torch.dtype:
    return next((p.dtype for p in drafter.parameters() if p.is_floating_point()), torch.float32)


def _package_version() -> str | None:
    """hspec's installed version; in a source tree run without installing (PYTHONPATH=src), its pyproject's."""
    try:
        return version("hspec")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"  # <repo>/src/hspec/drafters/
        if not pyproject.is_file():
            return None
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
        return found.group(1) if found else None


# ---- saving and loading a drafter --------------------------------------------------------------------


def save_drafter(drafter: NeuralDrafter, path: str | Path, verifier_name_or_path: str,
                 verifier_architectures: Sequence[str] | None = None) -> Path:
    """Write `drafter` as a Speculators-format checkpoint directory `path` (config.json + model.safetensors).

    verifier_name_or_path: the target's HF id or path, recorded for whoever loads the drafter.
    verifier_architectures: the target's HF architectures (default: the class the drafter was built for).
    The save is atomic: files go to a temporary sibling directory that replaces `path` only once complete.
    An existing `path` is replaced only if it is empty or a drafter checkpoint (`is_drafter_checkpoint`);
    anything else raises FileExistsError. Returns `path`.
    """
    if not isinstance(drafter, NeuralDrafter):
        raise TypeError(f"only trained drafters have checkpoints; got kind {getattr(drafter, 'kind', drafter)!r}")
    path = Path(path)
    check_replaceable(path, is_drafter_checkpoint, CHECKPOINT_WORDS)
    config = speculators_config(drafter, verifier_name_or_path, verifier_architectures)
    tensors = own_tensors(drafter)
    with atomic_directory(path) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def own_tensors(drafter: NeuralDrafter) -> dict[str, torch.Tensor]:
    """`drafter_state_dict()` as contiguous CPU tensors, refusing any that is the target's.

    The target's embedding and LM head are shared with the drafter, never registered in it; this
    check keeps a future kind that registers them by mistake from saving gigabytes of target weights.
    """
    try:
        parts = drafter.target_parts
        shared = [parts.embed_weight.untyped_storage().data_ptr(), parts.lm_head_weight.untyped_storage().data_ptr()]
    except RuntimeError:  # no target attached: nothing to confuse the drafter's tensors with
        shared = []
    tensors = {}
    for name, tensor in drafter.drafter_state_dict().items():
        if tensor.untyped_storage().data_ptr() in shared:
            raise ValueError(f"drafter {drafter.kind!r} state {name!r} is the target's embedding or LM head; "
                             "a drafter checkpoint holds only the drafter's own weights")
        # clone: safetensors refuses tensors that share memory with each other (views of one buffer).
        tensors[name] = tensor.detach().to("cpu").contiguous().clone()
    return tensors


def is_drafter_checkpoint(path: Path) -> bool:
    """Whether `path` holds a drafter checkpoint hspec wrote (`save_drafter`, `export_drafter`): a config.json
    naming a kind and carrying DRAFTER_CONFIG_KEY. What a save may replace; a model folder (a config.json of
    another kind) is not one."""
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and "speculators_model_type" in raw and DRAFTER_CONFIG_KEY in raw


@dataclass(frozen=True)
class CheckpointInfo:
    """What a drafter checkpoint's config.json says, before any weights are read."""

    path: Path  # the checkpoint directory
    kind: str  # the drafter kind (speculators_model_type)
    drafter_config: DrafterConfig  # rebuilt with the kind's config class
    verifier_name_or_path: str | None  # the target it was trained for
    verifier_architectures: tuple[str, ...]
    raw: dict[str, Any]  # the whole config.json


def read_checkpoint(path: str | Path) -> CheckpointInfo:
    """Read and check `path`/config.json; the errors name the file and what is wrong with it."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(_missing_message(path, config_path))
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path}: not a valid JSON file ({err})") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(raw).__name__}")
    kind = raw.get("speculators_model_type")
    if not kind:
        raise ValueError(f"{config_path}: no 'speculators_model_type'; not a Speculators drafter checkpoint")
    if DRAFTER_CONFIG_KEY not in raw:
        raise ValueError(f"{config_path}: speculators_model_type {kind!r} but no {DRAFTER_CONFIG_KEY!r}; this "
                         "checkpoint was not written by hspec and cannot be rebuilt here")
    if kind not in DRAFTERS:
        raise ValueError(f"{config_path}: drafter kind {kind!r} is not registered here; "
                         f"registered kinds: {DRAFTERS.names()}")
    cls = DRAFTERS.get(kind)
    if not (isinstance(cls, type) and issubclass(cls, NeuralDrafter)):
        raise ValueError(f"{config_path}: drafter kind {kind!r} is model-free and has no checkpoint")
    try:
        drafter_config = cls.config_class.from_dict(raw[DRAFTER_CONFIG_KEY])
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"{config_path}: invalid {DRAFTER_CONFIG_KEY} for kind {kind!r}: {err}") from err
    if drafter_config.kind != kind:
        raise ValueError(f"{config_path}: speculators_model_type is {kind!r} but {DRAFTER_CONFIG_KEY} is for "
                         f"kind {drafter_config.kind!r}")
    verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
    return CheckpointInfo(path, kind, drafter_config, verifier.get("name_or_path"),
                          tuple(verifier.get("architectures") or ()), raw)


def checkpoint_digest(path: str | Path) -> str:
    """A short sha256 of what makes the drafter at `path`: its weights file and its `DrafterConfig`.

    Two checkpoints with the same digest draft alike, whatever their directory names; a retrained drafter
    gets another one (evaluations record it, `hspec.eval.runner`). Fields of config.json that do not change
    the drafter (the hspec version that wrote it) are left out.
    """
    info = read_checkpoint(path)
    digest = hashlib.sha256(json.dumps(info.raw[DRAFTER_CONFIG_KEY], sort_keys=True).encode())
    weights = info.path / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(_missing_message(info.path, weights))
    with weights.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def load_drafter(path: str | Path, target_model: nn.Module, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, options: Mapping[str, Any] | None = None) -> NeuralDrafter:
    """Rebuild the drafter saved at `path` on `target_model` (a `TargetModel`) and load its weights strictly.

    The class comes from the registry by `speculators_model_type`, the config from DRAFTER_CONFIG_KEY, with
    `options` set on it: fields its config names in `decoding_options` (others raise ValueError naming them).
    The target must have the dimensions the drafter was trained for (V, H, L, Hq, Hkv, D); otherwise a
    ValueError names the checkpoint, the verifier it was trained for and the differing dimensions.
    device/dtype default to the target embedding's.
    """
    info = read_checkpoint(path)
    check_target_matches(info, target_model.config)  # type: ignore[arg-type]
    cls = DRAFTERS.get(info.kind)
    config = info.drafter_config
    if options:
        allowed = type(config).decoding_options
        if not set(options) <= set(allowed):
            raise ValueError(f"{path}: {sorted(set(options) - set(allowed))} cannot be set on a trained {info.kind} "
                             f"drafter; its decoding options are {sorted(allowed)}")
        config = dataclasses.replace(config, **options)
    drafter: NeuralDrafter = cls(target_model.config, target_model=target_model, config=config,
                                 device=device, dtype=dtype)
    load_weights(drafter, Path(path) / WEIGHTS_FILE)
    return drafter


def check_target_matches(info: CheckpointInfo, target: TargetConfig) -> None:
    """Raise ValueError, naming both, if `target` differs from the checkpoint's target in any tied dimension."""
    saved = info.drafter_config.target
    diffs = [f"{symbol} ({field}): {getattr(saved, field)} vs {getattr(target, field)}"
             for field, symbol in _TARGET_DIMS if getattr(saved, field) != getattr(target, field)]
    if diffs:
        trained_for = info.verifier_name_or_path or saved.architecture
        raise ValueError(f"drafter checkpoint {info.path} (kind {info.kind!r}, trained for target "
                         f"{trained_for!r}, {saved.architecture}) does not fit this target ({target.architecture}): "
                         f"checkpoint vs target: {'; '.join(diffs)}")


def load_weights(drafter: NeuralDrafter, weights_path: Path) -> None:
    """Load a safetensors file into `drafter` strictly: same keys as `drafter_state_dict()`, same shapes."""
    if not weights_path.is_file():
        raise FileNotFoundError(_missing_message(weights_path.parent, weights_path))
    try:
        state = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{weights_path}: unreadable safetensors file ({err})") from err
    expected = drafter.drafter_state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k}: {tuple(state[k].shape)} in file, {tuple(v.shape)} in drafter"
             for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        raise ValueError(f"{weights_path} does not match drafter {drafter.kind!r}: missing {missing}, "
                         f"unexpected {unexpected}, wrong shapes {wrong}")
    result = drafter.load_state_dict(state, strict=False)
    # Everything `drafter_state_dict` names was just checked; anything else load_state_dict reports
    # missing is state a kind chose not to save.
    leftover = sorted(set(result.missing_keys) & set(expected))
    if leftover or result.unexpected_keys:
        raise ValueError(f"{weights_path}: load left {leftover} unset and {result.unexpected_keys} unused")


def _missing_message(directory: Path, wanted: Path) -> str:
    """'<file> not found', naming the previous checkpoint if an interrupted save left it aside."""
    backups = sorted(directory.parent.glob(f".{directory.name}{OLD_MARK}*")) if directory.parent.exists() else []
    hint = f"; an interrupted save left the previous checkpoint at {backups[-1] / 'checkpoint'}" if backups else ""
    return f"{wanted} not found{hint}"


def export_drafter(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Copy a drafter checkpoint with its floating-point weights stored as `dtype` (to ship it smaller).

    Loading casts back to the model's dtype, so a bf16 export of an fp32-trained drafter loses only the
    low mantissa bits of its weights. Integer buffers (the draft vocabulary ids) are kept exactly.
    An existing `dst` is replaced only if it is empty or a drafter checkpoint (an earlier export); anything
    else raises FileExistsError before `src` is read.
    """
    src, dst = Path(src), Path(dst)
    check_replaceable(dst, is_drafter_checkpoint, CHECKPOINT_WORDS)
    info = read_checkpoint(src)
    state = load_file(str(src / "model.safetensors"))
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    with atomic_directory(dst) as staging:
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt", "kind": info.kind})
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst
