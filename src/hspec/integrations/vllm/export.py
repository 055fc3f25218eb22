"""Export an hspec DFlash checkpoint in the layout vLLM's `dflash` method loads (pinned: vLLM 0.32).

hspec saves its drafters in the Speculators layout (`hspec.drafters.checkpoint`), but four things in
it do not load in vLLM 0.32's DFlash path (`vllm/model_executor/models/qwen3_dflash.py` and the
`dflash` entry of `vllm/transformers_utils/configs/speculators/algos.py`):

1. weight names: hspec nests q/k/v under `self_attn.qkv.` (`layers.i.self_attn.qkv.q_proj.weight`);
   vLLM's Qwen3 attention expects `layers.i.self_attn.q_proj.weight` (it stacks q/k/v at load);
2. draft vocabulary: hspec stores the ids (`head.draft_vocab_ids`, (Vp,)) and never saves the
   target's LM head; vLLM wants its own `lm_head.weight` (Vp, H) plus `d2t` (Vp,) offsets, with
   target_id = draft_index + d2t[draft_index];
3. MASK: hspec's MASK slot holds id V, one past the target's vocabulary, embedded by the drafter's
   own `mask_embedding`; vLLM embeds `mask_token_id` from the (target-shared) embedding table, so
   the id must lie inside it. The learned embedding goes to `mask_embedding.pt`, which vLLM
   substitutes for that row, and `mask_token_id` becomes an id the target does not generate in
   practice (default: the last special token that is neither BOS nor EOS);
4. the block semantics: hspec's anchor slot predicts the first draft (`sample_from_anchor`), vLLM
   0.32's V1 DFlash samples only from the MASK slots. Greedy output stays equal to plain decoding
   whatever the drafts are (that is what the losslessness test checks), but acceptance depends on
   it: the export sets `sample_from_anchor`, and hspec's vLLM plugin (`plugin.py`) makes vLLM honour it.

The exported directory holds config.json (Speculators format, `speculators_model_type: dflash`),
model.safetensors and mask_embedding.pt. Embedding and RoPE are shared with the target at load.
`export_peagle_for_vllm` writes hspec's P-Eagle as vLLM's parallel EAGLE-3 (`method: eagle3`,
`parallel_drafting: true`, model `Eagle3Qwen3ForCausalLM`: hspec's drafter layers have q/k norms, as
Qwen3's do): the same attention renaming, LM head and d2t; `mask_hidden` (n_sel*H) as it is (vLLM
projects it through `fc` as hspec does); and, since vLLM's EAGLE embeds the MASK slots' `pard_token` id
from its embedding table, `embed_tokens.weight` = the target's table with that row replaced by hspec's
learned MASK embedding (a table of its own: vLLM then does not share the target's).
No other kind is exported: vLLM has no Markov head (`dspark`) and no target-KV reuse.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hspec.drafters import DRAFTERS, vllm_exported_kinds
from hspec.drafters.checkpoint import CONFIG_FILE, DRAFTER_CONFIG_KEY, WEIGHTS_FILE, read_checkpoint
from hspec.durable import atomic_directory, check_replaceable

MASK_EMBEDDING_FILE = "mask_embedding.pt"


def vllm_weight_name(name: str) -> str | None:
    """The vLLM DFlash name of one hspec drafter tensor, or None for tensors exported differently.

    `layers.i.self_attn.qkv.q_proj.weight` -> `layers.i.self_attn.q_proj.weight` (also k/v and the
    q/k norms); every other layer, `norm`, `fc` and `hidden_norm` keep their names. The mask embedding
    and the draft-vocabulary ids are handled by `export_dflash_for_vllm` itself.
    """
    if name in ("mask_embedding", "head.draft_vocab_ids"):
        return None
    return name.replace(".self_attn.qkv.", ".self_attn.")


def draft_to_target_offsets(draft_vocab_ids: torch.Tensor) -> torch.Tensor:
    """vLLM's `d2t` (Vp,) from hspec's draft-vocabulary ids (Vp,): d2t[i] = ids[i] - i.

    vLLM maps a draft index i to target id i + d2t[i] and requires the ids sorted ascending (its
    logits scatter relies on it only through this formula, but Speculators' exporter writes them
    sorted, and so do we: rows of the LM head are reordered with the ids).
    """
    if draft_vocab_ids.dim() != 1:
        raise ValueError(f"draft_vocab_ids must be (Vp,), got {tuple(draft_vocab_ids.shape)}")
    return draft_vocab_ids.long() - torch.arange(draft_vocab_ids.shape[0], dtype=torch.long)


def read_target_embedding(target_dir: Path) -> torch.Tensor:
    """The target's input embedding table (V, H) from its HF folder."""
    for path in sorted(target_dir.glob("*.safetensors")):
        state = load_file(str(path))
        if "model.embed_tokens.weight" in state:
            return state["model.embed_tokens.weight"]
    raise ValueError(f"{target_dir}: no model.embed_tokens.weight in its *.safetensors")


def read_target_lm_head(target_dir: Path) -> torch.Tensor:
    """The target's LM head (V, H) from its HF folder (the tied embedding when there is no lm_head)."""
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in the target folder {target_dir}")
    embed = None
    for path in files:
        state = load_file(str(path))
        if "lm_head.weight" in state:
            return state["lm_head.weight"]
        embed = state.get("model.embed_tokens.weight", embed)
    if embed is None:
        raise ValueError(f"{target_dir}: neither lm_head.weight nor model.embed_tokens.weight found")
    return embed


def pick_mask_token_id(target_dir: Path, reserved_ids: set[int]) -> int:
    """An id inside the target's table for vLLM's MASK slots: the last special token not in `reserved_ids`.

    The id only tags the MASK slots (vLLM replaces its embedding by `mask_embedding.pt` wherever it
    appears); an anchor equal to it would be embedded as MASK, which can cost acceptance but never
    correctness. `reserved_ids` are BOS/EOS; the other special tokens (SmolLM2: `<empty_output>`, ...)
    are not generated by a chat model in practice.
    """
    added = json.loads((target_dir / "tokenizer.json").read_text()).get("added_tokens", [])
    candidates = sorted(int(t["id"]) for t in added if t.get("special") and int(t["id"]) not in reserved_ids)
    if not candidates:
        raise ValueError(f"{target_dir}: no special token outside {sorted(reserved_ids)} to use as MASK; pass "
                         "mask_token_id explicitly")
    return candidates[-1]


def _vllm_tensors(state: dict[str, torch.Tensor], target_dir: Path, target: dict[str, Any], dtype: torch.dtype
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The drafter's tensors under vLLM's names, plus `lm_head.weight` (Vp, H) and `d2t` (Vp,); and the
    draft ids (Vp,), sorted ascending as vLLM's d2t wants them."""
    ids = torch.sort(state["head.draft_vocab_ids"].long()).values  # (Vp,)
    lm_head = read_target_lm_head(target_dir)  # (V, H)
    if lm_head.shape != (target["vocab_size"], target["hidden_size"]):
        raise ValueError(f"target LM head in {target_dir} is {tuple(lm_head.shape)}, the checkpoint's target is "
                         f"(V, H) = ({target['vocab_size']}, {target['hidden_size']})")
    tensors = {vllm_weight_name(n): t for n, t in state.items() if vllm_weight_name(n) is not None}
    tensors["lm_head.weight"] = lm_head[ids]  # (Vp, H), the frozen rows hspec's head reads
    tensors = {n: t.to(dtype).contiguous() for n, t in tensors.items()}
    tensors["d2t"] = draft_to_target_offsets(ids)  # (Vp,) long
    return tensors, ids


def _mask_id(mask_token_id: int | None, target_dir: Path, target: dict[str, Any]) -> int:
    """`mask_token_id`, or `pick_mask_token_id`'s; checked to lie inside the target's table."""
    reserved = set(target.get("eos_token_ids") or []) | {target.get("bos_token_id")}
    mask_id = mask_token_id if mask_token_id is not None else pick_mask_token_id(target_dir, reserved)
    if not 0 <= mask_id < target["vocab_size"]:
        raise ValueError(f"mask_token_id must be a target id in 0..{target['vocab_size'] - 1}, got {mask_id}")
    return mask_id


def is_vllm_export(path: str | Path) -> bool:
    """True for a directory this module wrote (vLLM layout); False for an hspec checkpoint, or anything else
    (no readable config.json)."""
    try:
        config = json.loads((Path(path) / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and "hspec_source" in config and DRAFTER_CONFIG_KEY not in config


def _check_destination(dst: Path) -> None:
    """Refuse (FileExistsError) a `dst` that exists and is neither empty nor an earlier export: the export
    replaces it whole."""
    check_replaceable(dst, is_vllm_export, "an earlier vLLM export of an hspec drafter")


def _check_method(src: Path, kind: str, method: str, writer: str) -> None:
    """Raise ValueError unless drafter `kind` declares vLLM `method` (`Drafter.vllm_method`), naming the kind
    that does."""
    if DRAFTERS.get(kind).vllm_method != method:
        raise ValueError(f"{src} holds a {kind!r} drafter; {writer} takes {vllm_exported_kinds().get(method)!r} "
                         f"(the kinds vLLM serves, by method: {vllm_exported_kinds()})")


def export_for_vllm(src: str | Path, dst: str | Path, target_dir: str | Path, K: int | None = None,
                    mask_token_id: int | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write the checkpoint `src` in the layout of the vLLM method its kind declares (`Drafter.vllm_method`):
    `export_dflash_for_vllm` or `export_peagle_for_vllm`, whose arguments these are. Returns `dst`."""
    kind = read_checkpoint(Path(src)).kind
    method = DRAFTERS.get(kind).vllm_method
    if method is None:
        raise ValueError(f"{src} holds a {kind!r} drafter, which vLLM serves no export of "
                         f"(exported kinds: {sorted(vllm_exported_kinds().values())})")
    return WRITERS[method](src, dst, target_dir, K, mask_token_id, dtype)


def export_dflash_for_vllm(src: str | Path, dst: str | Path, target_dir: str | Path, K: int | None = None,
                           mask_token_id: int | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write hspec's DFlash checkpoint `src` as a vLLM-loadable DFlash drafter at `dst`.

    target_dir: the target's HF folder (the one vLLM serves; its LM head rows become the drafter's
    `lm_head.weight`). K: drafts per step vLLM proposes, written as its `num_speculative_tokens` (default:
    the trained draft length less one, since vLLM adds the anchor slot in front of K MASK slots). mask_token_id:
    default `pick_mask_token_id`. An existing `dst` is replaced only if it is empty or an earlier export
    (`is_vllm_export`); anything else raises FileExistsError. Returns `dst`.
    """
    src, dst, target_dir = Path(src), Path(dst), Path(target_dir)
    _check_destination(dst)
    info = read_checkpoint(src)
    _check_method(src, info.kind, "dflash", "export_dflash_for_vllm")
    raw: dict[str, Any] = json.loads((src / CONFIG_FILE).read_text())
    drafter_config = raw[DRAFTER_CONFIG_KEY]
    target = drafter_config["target"]
    max_draft_len = info.drafter_config.max_draft_len  # K_train: the trained block
    K = K if K is not None else max_draft_len - 1
    if not 1 <= K <= max_draft_len:
        raise ValueError(f"K (vLLM's num_speculative_tokens) must be in 1..{max_draft_len} (the trained draft "
                         f"length), got {K}")

    state = load_file(str(src / WEIGHTS_FILE))
    tensors, ids = _vllm_tensors(state, target_dir, target, dtype)
    mask_id = _mask_id(mask_token_id, target_dir, target)

    config = {
        **_speculators_header(raw, "dflash", "DFlashDraftModel", K),
        "transformer_layer_config": raw["transformer_layer_config"],
        "draft_vocab_size": int(ids.shape[0]),
        "target_hidden_size": target["hidden_size"],
        "aux_hidden_state_layer_ids": list(drafter_config["target_layers"]),  # HF indices; vLLM subtracts 1
        "mask_token_id": mask_id,
        "block_size": max_draft_len,  # Speculators' DFlash name for the trained draft length
        # hspec's semantics (docs/design.md#the-decoding-step); vLLM honours it through hspec's plugin.
        "sample_from_anchor": True,
        # A DFlash block is bidirectional: tell vLLM not to apply its causal mask inside it.
        "sliding_window_non_causal": True,
        "hspec_source": {"path": str(src), "kind": info.kind,
                         "hspec_mask_token_id": drafter_config.get("mask_token_id")},
    }
    with atomic_directory(dst) as staging:
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        torch.save({"mask_token_id": mask_id, "embedding": state["mask_embedding"].to(dtype).clone()},
                   staging / MASK_EMBEDDING_FILE)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return dst


def export_peagle_for_vllm(src: str | Path, dst: str | Path, target_dir: str | Path, K: int | None = None,
                           mask_token_id: int | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write hspec's P-Eagle checkpoint `src` as vLLM's parallel EAGLE-3 drafter at `dst` (module docstring).

    K: vLLM's `num_speculative_tokens`, default the trained draft length (vLLM's parallel EAGLE drafts K tokens
    from the last verified entry plus K - 1 MASK entries, hspec's block). `dst` as in `export_dflash_for_vllm`.
    Returns `dst`.
    """
    src, dst, target_dir = Path(src), Path(dst), Path(target_dir)
    _check_destination(dst)
    info = read_checkpoint(src)
    _check_method(src, info.kind, "eagle3", "export_peagle_for_vllm")
    raw: dict[str, Any] = json.loads((src / CONFIG_FILE).read_text())
    drafter_config = raw[DRAFTER_CONFIG_KEY]
    target = drafter_config["target"]
    max_draft_len = info.drafter_config.max_draft_len
    K = K if K is not None else max_draft_len
    if not 1 <= K <= max_draft_len:
        raise ValueError(f"K (vLLM's num_speculative_tokens) must be in 1..{max_draft_len} (the trained draft "
                         f"length), got {K}")
    state = load_file(str(src / WEIGHTS_FILE))
    tensors, ids = _vllm_tensors(state, target_dir, target, dtype)
    mask_id = _mask_id(mask_token_id, target_dir, target)
    embed = read_target_embedding(target_dir).to(dtype).clone()  # (V, H)
    embed[mask_id] = state["mask_embedding"].to(dtype)
    tensors["embed_tokens.weight"] = embed
    tensors["mask_hidden"] = state["mask_hidden"].to(dtype).contiguous()  # (n_sel*H,)

    layer_config = {
        **raw["transformer_layer_config"],
        "model_type": "qwen3",  # vLLM: PeagleQwen3ForCausalLM -> Eagle3Qwen3ForCausalLM (q/k norms)
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": info.drafter_config.num_layers,
        "hidden_size": target["hidden_size"], "intermediate_size": target["intermediate_size"],
        "num_attention_heads": target["num_heads"], "num_key_value_heads": target["num_kv_heads"],
        "head_dim": target["head_dim"], "rms_norm_eps": target["rms_norm_eps"], "rope_theta": target["rope_theta"],
        "max_position_embeddings": target["max_position_embeddings"], "vocab_size": target["vocab_size"],
        "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False,
    }
    config = {
        **_speculators_header(raw, "peagle", "PEagleSpeculator", K),
        "transformer_layer_config": layer_config,
        "draft_vocab_size": int(ids.shape[0]),
        "target_hidden_size": target["hidden_size"],
        # vLLM's aux layer l is the input of decoder layer l: hspec's HF hidden-state index l.
        "eagle_aux_hidden_state_layer_ids": list(drafter_config["target_layers"]),
        "mask_token_id": mask_id,
        "norm_before_residual": False,  # hspec's fused layer keeps the un-normed feature as its residual
        "norm_before_fc": False,
        "hspec_source": {"path": str(src), "kind": info.kind,
                         "hspec_mask_token_id": drafter_config.get("mask_token_id")},
    }
    with atomic_directory(dst) as staging:
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return dst


def _speculators_header(raw: dict[str, Any], algorithm: str, architecture: str, K: int) -> dict[str, Any]:
    """The Speculators-format keys every export shares: type, version, architecture, and the config of one
    greedy proposal method drafting K tokens a step (vLLM reads `speculative_tokens` as its default K)."""
    return {
        "speculators_model_type": algorithm,
        "speculators_version": raw.get("speculators_version"),
        "architectures": [architecture],
        "speculators_config": {
            **raw["speculators_config"],
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": K,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
        },
    }


# The export writer of each vLLM method a drafter kind may declare (`Drafter.vllm_method`).
WRITERS = {"dflash": export_dflash_for_vllm, "eagle3": export_peagle_for_vllm}
