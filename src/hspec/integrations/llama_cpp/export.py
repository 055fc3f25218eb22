"""Export an hspec DFlash or DSpark checkpoint as the GGUF llama.cpp drafts with (`--spec-type draft-dspark`).

llama.cpp (the October 2026 build llama-cpp-python 0.3.36 vendors) has one architecture, `dflash`, for the
DFlash family (`src/models/dflash.cpp`): an "encoder" W_fc + RMSNorm over the concatenated inputs of the
target layers `dflash.target_layers`, whose output each layer projects with its own W_k (k-norm, RoPE) and
W_v into the drafter's KV cache; then Qwen3-style layers over the block [x0, MASK, ...], non-causal, a final
RMSNorm, an LM head over the draft vocabulary scattered to the target's by `d2t`, and optionally DSpark's
Markov head l_k += W2 W1[prev_k] chained greedily over the slots. That is hspec's `dflash` and `dspark`
(drafters/dflash/model.py) layer for layer, so the export is a renaming plus four decisions:

1. the block layout. hspec's anchor slot predicts the first draft (`sample_from_anchor`: slot k at position
   p+k predicts x_{p+k+1}, K drafts from a K-slot block). llama.cpp's `draft-dspark` type reads the block
   that way when `dflash.sample_from_anchor` is true; its `draft-dflash` type is z-lab's layout (slot 0
   unread, slot k predicts x_{p+k}), which would shift every draft by one position. Both kinds therefore
   run under `--spec-type draft-dspark`; a `dflash` export has no Markov head, and llama.cpp then drafts
   with the backbone alone. Auto-detection (no --spec-type) would pick `draft-dflash` for it: name the type.
2. the MASK slot. hspec's MASK is id V, one past the target's table, embedded by the learned
   `mask_embedding`; llama.cpp embeds `tokenizer.ggml.mask_token_id` from the drafter's own `token_embd`.
   The GGUF carries the target's table with one row, an id the target does not generate in practice (the
   vLLM export's choice, `pick_mask_token_id`), replaced by the learned embedding.
3. the draft vocabulary. hspec stores the ids (Vp,); the GGUF holds `output.weight` = the target's LM head
   rows at those ids, sorted ascending, and `d2t` (Vp,) int64 = the ids themselves (llama.cpp's converter
   writes absolute target ids; `load_arch_tensors` sizes the head by it). The Markov W2 (r, Vp) is stored
   transposed, its columns in the same sorted order. A full vocabulary (Vp = V) needs no `d2t`.
4. the context window. hspec's block sees the last `sliding_window` positions before the anchor; the
   GGUF sets llama.cpp's standard sliding window of the same size on every layer (llama.cpp counts it
   from each query position, so at contexts past the window slot k sees k fewer keys than hspec's).

Refused, with what to train instead: `dflash2` (llama.cpp's DFlash-2 selector walk starts at slot 1 with the
anchor as slot 1's predecessor, z-lab's layout, and has no anchor-first mode), `dflash-kvreuse` (llama.cpp's
drafter keeps its own KV cache and cannot read the target's in place), every other kind, and RoPE scalings
other than none and llama3 (llama3's factors go in `rope_freqs.weight`, as llama.cpp's Llama converter does).

The tokenizer comes from the target's GGUF (every `tokenizer.*` key copied): llama.cpp checks that drafter
and target vocabularies agree. Qwen-family targets export the same way (the drafter's layers are Qwen3's
whatever the target; the tokenizer is whatever the target's GGUF holds).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from hspec.drafters import DRAFTERS
from hspec.drafters.checkpoint import CONFIG_FILE, DRAFTER_CONFIG_KEY, WEIGHTS_FILE, read_checkpoint
from hspec.integrations.vllm.export import pick_mask_token_id, read_target_embedding, read_target_lm_head

ARCH = "dflash"  # llama.cpp's architecture for the whole DFlash family
SPEC_TYPE = "draft-dspark"  # the llama.cpp speculative type whose block layout is hspec's (module doc, 1.)
GGUF_DTYPES = {"f32": np.float32, "f16": np.float16}
SOURCE_KEY = "hspec.source"  # JSON: the checkpoint, its kind and the target it was exported against

# Kinds llama.cpp cannot run, and what to train instead.
_REFUSED = {
    "dflash2": "llama.cpp's DFlash-2 selector walks the block from slot 1 with the anchor as slot 1's predecessor "
               "(z-lab's layout) and has no anchor-first mode, so hspec's DFlash-2 drafts would land one position "
               "off; train --drafter dspark (its Markov head is what llama.cpp chains per slot) or dflash",
    "dflash-kvreuse": "llama.cpp's drafter keeps its own KV cache and cannot read the target's in place; train "
                      "--drafter dflash (the same backbone with its own context K/V)",
}

# hspec's name of each per-layer tensor -> llama.cpp's (`blk.<i>.` prefixed).
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.qkv.q_proj.weight": "attn_q.weight",
    "self_attn.qkv.k_proj.weight": "attn_k.weight",
    "self_attn.qkv.v_proj.weight": "attn_v.weight",
    "self_attn.qkv.q_norm.weight": "attn_q_norm.weight",
    "self_attn.qkv.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Whole-drafter tensors -> llama.cpp's names.
_GLOBAL_NAMES = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
                 "norm.weight": "output_norm.weight"}


def gguf_tensor_name(name: str) -> str | None:
    """llama.cpp's name of one hspec drafter tensor, or None for those exported differently (the mask
    embedding, the draft-vocabulary ids and the Markov head: `export_gguf` builds theirs)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER_NAMES:
        return f"blk.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def check_exportable(kind: str, drafter_config: dict[str, Any]) -> None:
    """Raise ValueError, saying what to train instead, when llama.cpp cannot run this drafter."""
    if kind in _REFUSED:
        raise ValueError(f"cannot export a {kind!r} drafter to llama.cpp: {_REFUSED[kind]}")
    if DRAFTERS.get(kind).llama_cpp_arch != ARCH:
        exportable = [k for k in DRAFTERS.names() if DRAFTERS.get(k).llama_cpp_arch == ARCH]
        raise ValueError(f"cannot export a {kind!r} drafter to llama.cpp: its `{ARCH}` architecture runs the "
                         f"DFlash family only; train --drafter {' or '.join(exportable)} (the kinds that declare it)")
    rope = drafter_config["target"]["rope_scaling"]["rope_type"]
    if rope not in ("default", "llama3"):
        raise ValueError(f"cannot export: the target's RoPE scaling {rope!r} has no mapping to llama.cpp's DFlash "
                         "drafter here (none and llama3 do)")


def llama3_rope_factors(target: dict[str, Any]) -> np.ndarray:
    """(D/2,) float32 llama3 frequency divisors, as llama.cpp's Llama converter computes `rope_freqs.weight`."""
    scaling, dim = target["rope_scaling"], target["head_dim"]
    freqs = 1.0 / (target["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    old = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


@dataclass(frozen=True)
class GGUFExport:
    """What `export_gguf` wrote: the file and the facts a llama.cpp command line needs."""

    path: Path
    kind: str
    max_draft_len: int  # the trained draft length: the most drafts a step llama.cpp proposes (`--spec-draft-n-max`)
    mask_token_id: int  # the target id whose embedding row holds hspec's learned MASK embedding
    draft_vocab_size: int  # Vp

    def llama_cli_args(self, target_gguf: str | Path) -> list[str]:
        """The llama.cpp arguments that run this drafter against `target_gguf`."""
        return ["-m", str(target_gguf), "-md", str(self.path), "--spec-type", SPEC_TYPE,
                "--spec-draft-n-max", str(self.max_draft_len)]


def _tokenizer_fields(reader: gguf.GGUFReader) -> Iterator[tuple[str, Any, list[gguf.GGUFValueType]]]:
    """(key, value, types) of every `tokenizer.*` key of a GGUF."""
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            yield key, field.contents(), list(field.types)


def _is_our_export(path: Path) -> bool:
    """True for a GGUF this module wrote (what an export may replace)."""
    try:
        return SOURCE_KEY in gguf.GGUFReader(str(path)).fields
    except Exception:  # not a GGUF at all: gguf raises ValueError, struct.error, ...
        return False


def export_gguf(src: str | Path, dst: str | Path, target_gguf: str | Path, target_dir: str | Path,
                dtype: str = "f16", mask_token_id: int | None = None) -> GGUFExport:
    """Write hspec's `dflash`/`dspark` checkpoint `src` as llama.cpp's drafter GGUF `dst` (module doc).

    target_gguf: the target's GGUF as llama.cpp will run it (its tokenizer is copied). target_dir: the
    target's safetensors folder (for a GGUF target, hspec's conversion of it: `resolve_target_dir`), whose
    embedding and LM head the drafter shares. dtype: "f16" or "f32" for the matrices (norms stay f32).
    mask_token_id: default `pick_mask_token_id`. An existing `dst` is replaced only if an earlier export
    wrote it; anything else raises FileExistsError.
    """
    src, dst, target_gguf, target_dir = Path(src), Path(dst), Path(target_gguf), Path(target_dir)
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(GGUF_DTYPES)}, got {dtype!r}")
    if dst.exists() and not _is_our_export(dst):
        raise FileExistsError(f"refusing to replace {dst}: it exists and is not a GGUF this export wrote")
    info = read_checkpoint(src)
    drafter_config: dict[str, Any] = json.loads((src / CONFIG_FILE).read_text())[DRAFTER_CONFIG_KEY]
    check_exportable(info.kind, drafter_config)
    target = drafter_config["target"]
    V, H = target["vocab_size"], target["hidden_size"]
    reader = gguf.GGUFReader(str(target_gguf))
    vocab = reader.fields.get("tokenizer.ggml.tokens")
    if vocab is None or len(vocab.data) != V:
        raise ValueError(f"{target_gguf} has {0 if vocab is None else len(vocab.data)} tokens, the drafter's "
                         f"target has V = {V}: export against the GGUF the drafter was trained for")
    reserved = set(target.get("eos_token_ids") or []) | {target.get("bos_token_id")}
    mask_id = mask_token_id if mask_token_id is not None else pick_mask_token_id(target_dir, reserved)
    if not 0 <= mask_id < V:
        raise ValueError(f"mask_token_id must be a target id in 0..{V - 1}, got {mask_id}")

    state = load_file(str(src / WEIGHTS_FILE))
    matrix = GGUF_DTYPES[dtype]

    def array(t: torch.Tensor, dense: bool) -> np.ndarray:
        """A float tensor as the GGUF stores it: matrices in `dtype`, vectors (norms) in f32."""
        return t.detach().float().numpy().astype(matrix if dense and t.dim() > 1 else np.float32)

    # 3. the draft vocabulary, sorted ascending with every tensor indexed by it.
    ids = state["head.draft_vocab_ids"].long()  # (Vp,)
    order = torch.argsort(ids)
    ids = ids[order]
    lm_head = read_target_lm_head(target_dir)  # (V, H)
    embed = read_target_embedding(target_dir).clone()  # (V, H)
    if lm_head.shape != (V, H) or embed.shape != (V, H):
        raise ValueError(f"target tensors in {target_dir} are {tuple(embed.shape)} / {tuple(lm_head.shape)}, the "
                         f"checkpoint's target has (V, H) = ({V}, {H})")
    embed[mask_id] = state["mask_embedding"].to(embed.dtype)  # 2. the MASK row
    tensors: dict[str, np.ndarray] = {"token_embd.weight": array(embed, True),
                                      "output.weight": array(lm_head[ids], True)}  # (Vp, H)
    if ids.shape[0] < V:
        tensors["d2t"] = ids.numpy().astype(np.int64)  # absolute target ids
    for name, t in state.items():
        gname = gguf_tensor_name(name)
        if gname is not None:
            tensors[gname] = array(t, True)
    if "markov.W1.weight" in state:
        tensors["markov_w1.weight"] = array(state["markov.W1.weight"], True)  # (V, r)
        tensors["markov_w2.weight"] = array(state["markov.W2"][:, order].t().contiguous(), True)  # (Vp, r)
    if target["rope_scaling"]["rope_type"] == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(target)

    num_layers = drafter_config["num_layers"]
    max_draft_len = int(drafter_config["max_draft_len"])
    writer_path = Path(tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent or ".")[1])
    try:
        writer = gguf.GGUFWriter(str(writer_path), ARCH)
        writer.add_name(f"hspec {info.kind} drafter")
        a = f"{ARCH}."
        writer.add_uint32(a + "context_length", target["max_position_embeddings"])
        writer.add_uint32(a + "embedding_length", H)
        writer.add_uint32(a + "block_count", num_layers)
        writer.add_uint32(a + "feed_forward_length", target["intermediate_size"])
        writer.add_uint32(a + "attention.head_count", target["num_heads"])
        writer.add_uint32(a + "attention.head_count_kv", target["num_kv_heads"])
        writer.add_uint32(a + "attention.key_length", target["head_dim"])
        writer.add_uint32(a + "attention.value_length", target["head_dim"])
        writer.add_float32(a + "attention.layer_norm_rms_epsilon", target["rms_norm_eps"])
        writer.add_float32(a + "rope.freq_base", target["rope_theta"])
        writer.add_uint32(a + "rope.dimension_count", target["head_dim"])
        writer.add_uint32(a + "vocab_size", V)
        writer.add_array(a + "target_layers", list(drafter_config["target_layers"]))  # HF indices = layer inputs
        writer.add_uint32(a + "block_size", max_draft_len)  # llama.cpp's DFlash name for it
        writer.add_bool(a + "sample_from_anchor", True)  # 1.
        writer.add_bool(a + "attention.causal", False)  # bidirectional inside the block
        writer.add_uint32(a + "attention.sliding_window", int(drafter_config["sliding_window"]))  # 4.
        writer.add_array(a + "attention.sliding_window_pattern", [True] * num_layers)
        for key, value, types in _tokenizer_fields(reader):
            if key != "tokenizer.ggml.mask_token_id":
                writer.add_key_value(key, value, types[0], sub_type=types[-1] if len(types) > 1 else None)
        writer.add_uint32("tokenizer.ggml.mask_token_id", mask_id)
        writer.add_string(SOURCE_KEY, json.dumps({"checkpoint": str(src), "kind": info.kind,
                                                  "target_gguf": str(target_gguf), "dtype": dtype}))
        for name, data in tensors.items():
            writer.add_tensor(name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        writer_path.chmod(0o644)  # mkstemp's 0600 would hide the model from a llama.cpp run as another user
        os.replace(writer_path, dst)
    finally:
        writer_path.unlink(missing_ok=True)
    return GGUFExport(dst, info.kind, max_draft_len, mask_id, int(ids.shape[0]))
