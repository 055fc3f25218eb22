"""hspec's DFlash/DSpark drafters in llama.cpp (docs/llama-cpp.md).

The export's layout is checked everywhere on tiny targets (a GGUF holding only their vocabulary stands in
for the target's). The runs inside llama.cpp (marker `llama_cpp`) need the binaries of
scripts/build_llama_cpp.sh and are skipped without them: llama.cpp greedy with an exported random-weight
drafter equals llama.cpp plain greedy token for token, on the real SmolLM2 GGUF.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from conftest import load_tiny
from hspec.drafters import create_drafter
from hspec.drafters.checkpoint import save_drafter
from hspec.drafters.dflash import DFlashConfig
from hspec.integrations.llama_cpp.binaries import Completion, LlamaServer, find_bin_dir
from hspec.integrations.llama_cpp.export import SPEC_TYPE, check_exportable, export_gguf, gguf_tensor_name
from hspec.integrations.vllm.export import read_target_lm_head


def vocab_gguf(path, vocab_size: int):
    """A GGUF holding only a tokenizer of `vocab_size` tokens: what the export copies from a target's."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab_size)])
    writer.add_token_types([3] * 4 + [1] * (vocab_size - 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    """A tensor of a GGUF in torch's (rows, columns) order."""
    t = next(t for t in reader.tensors if t.name == name)
    return np.asarray(t.data).reshape(tuple(reversed([int(x) for x in t.shape])))


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def test_tensor_names_follow_llama_cpp():
    assert gguf_tensor_name("layers.2.self_attn.qkv.k_norm.weight") == "blk.2.attn_k_norm.weight"
    assert gguf_tensor_name("layers.0.post_attention_layernorm.weight") == "blk.0.ffn_norm.weight"
    assert gguf_tensor_name("hidden_norm.weight") == "enc.output_norm.weight"
    assert gguf_tensor_name("fc.weight") == "fc.weight"
    assert gguf_tensor_name("mask_embedding") is None  # goes into token_embd's MASK row
    assert gguf_tensor_name("markov.W2") is None  # transposed and reordered apart


@pytest.mark.parametrize("kind, words", [("dflash2", "train --drafter dspark"), ("dflash-kvreuse", "dflash"),
                                         ("hspec", "train --drafter dflash or dspark")])
def test_kinds_llama_cpp_cannot_run_are_refused_with_what_to_train(kind, words):
    config = {"target": {"rope_scaling": {"rope_type": "default"}}}
    with pytest.raises(ValueError, match=words):
        check_exportable(kind, config)
    with pytest.raises(ValueError, match="yarn"):
        check_exportable("dflash", {"target": {"rope_scaling": {"rope_type": "yarn"}}})


@pytest.mark.parametrize("family", ["llama", "qwen3", "llama3-scaled"])
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_export_holds_the_drafter_in_llama_cpp_layout(kind, family, tiny_dirs, tmp_path):
    """Every tensor where llama.cpp reads it: the head rows and the Markov W2 columns in sorted draft-vocabulary
    order with d2t the sorted ids, the learned MASK embedding in token_embd's MASK row, anchor-first layout."""
    target = load_tiny(tiny_dirs[family])
    torch.manual_seed(0)
    V = target.config.vocab_size
    rank = 8 if kind == "dspark" else 0
    config = DFlashConfig.from_target(kind, target.config, draft_vocab_size=48, markov_rank=rank)
    drafter = create_drafter(kind, target.config, target_model=target.model, config=config)
    ids = torch.randperm(V)[:48]
    drafter.head.set_vocab(ids)
    if kind == "dspark":
        torch.nn.init.normal_(drafter.markov.W2)
    path = save_drafter(drafter, tmp_path / "ckpt", "tiny")
    out = export_gguf(path, tmp_path / "d.gguf", vocab_gguf(tmp_path / "v.gguf", V), tiny_dirs[family], "f32",
                      mask_token_id=5)
    assert (out.kind, out.max_draft_len, out.mask_token_id, out.draft_vocab_size) == (kind, 7, 5, 48)
    reader = gguf.GGUFReader(str(out.path))
    assert field(reader, "general.architecture") == "dflash"
    assert field(reader, "dflash.target_layers") == list(config.target_layers)
    assert field(reader, "dflash.sample_from_anchor") is True
    assert field(reader, "dflash.block_size") == 7
    assert field(reader, "tokenizer.ggml.mask_token_id") == 5
    assert len(field(reader, "tokenizer.ggml.tokens")) == V

    order = torch.argsort(ids)
    sorted_ids = ids[order]
    lm_head = read_target_lm_head(tiny_dirs[family])  # (V, H)
    assert np.array_equal(tensor(reader, "d2t"), sorted_ids.numpy())
    embed = tensor(reader, "token_embd.weight")
    assert np.allclose(embed[5], drafter.mask_embedding.detach().numpy())
    head = tensor(reader, "output.weight")
    assert head.shape == (48, target.config.hidden_size)
    assert np.allclose(head, lm_head[sorted_ids].numpy())
    assert np.allclose(tensor(reader, "blk.1.attn_k.weight"),
                       drafter.layers[1].self_attn.qkv.k_proj.weight.detach().numpy())
    names = {t.name for t in reader.tensors}
    assert ("rope_freqs.weight" in names) == (family == "llama3-scaled")
    if kind == "dspark":
        w2 = tensor(reader, "markov_w2.weight")  # (Vp, r), row i = draft id sorted_ids[i]
        assert np.allclose(w2, drafter.markov.W2.detach()[:, order].t().numpy())
        assert tensor(reader, "markov_w1.weight").shape == (V, 8)
    else:
        assert "markov_w1.weight" not in names
    assert out.llama_cli_args("t.gguf")[4:6] == ["--spec-type", SPEC_TYPE]


def test_export_refuses_to_overwrite_what_it_did_not_write(tiny_dirs, tmp_path):
    target = load_tiny(tiny_dirs["llama"])
    drafter = create_drafter("dflash", target.config, target_model=target.model,
                             config=DFlashConfig.from_target("dflash", target.config, draft_vocab_size=48))
    path = save_drafter(drafter, tmp_path / "ckpt", "tiny")
    notes = tmp_path / "notes.gguf"
    notes.write_text("mine")
    vocab = vocab_gguf(tmp_path / "v.gguf", target.config.vocab_size)
    with pytest.raises(FileExistsError, match="not a GGUF this export wrote"):
        export_gguf(path, notes, vocab, tiny_dirs["llama"], mask_token_id=5)
    with pytest.raises(ValueError, match="tokens"):
        export_gguf(path, tmp_path / "d.gguf", vocab_gguf(tmp_path / "w.gguf", 7), tiny_dirs["llama"], mask_token_id=5)


def test_tau_from_llama_cpp_counters():
    # 33 tokens: the first from the prefill, 32 from 8 target forwards that accepted 24 drafts.
    c = Completion(tokens=[], prompt_n=10, prompt_ms=10.0, predicted_n=33, predicted_ms=320.0, draft_n=56,
                   draft_accepted=24)
    assert c.target_steps == 8 and c.tau == 4.0
    assert c.decode_tok_s == 100.0  # 32 steps' tokens in 320 ms, as llama.cpp's predicted_per_second
    assert c.prefill_tok_s == 1000.0


# ---- inside llama.cpp ----------------------------------------------------------------------------------

needs_binaries = pytest.mark.skipif(find_bin_dir() is None,
                                    reason="llama.cpp's binaries are not built (bash scripts/build_llama_cpp.sh)")


@pytest.mark.llama_cpp
@needs_binaries
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_llama_cpp_greedy_with_hspec_drafter_equals_plain(kind, smollm2, tmp_path):
    """llama.cpp greedy with an exported random-weight hspec drafter (draft-dspark) equals llama.cpp plain
    greedy token for token, and the drafter did draft (draft_n > 0): the format loads, and drafting through
    it is lossless. One thread each: two threads wait on each other behind any other process on a shared
    CPU (minutes a test), and both servers run alike."""
    from hspec.models.loading import default_gguf_path

    torch.manual_seed(0)
    config = DFlashConfig.from_target(kind, smollm2.config, draft_vocab_size=8192)
    drafter = create_drafter(kind, smollm2.config, target_model=smollm2.model, config=config)
    drafter.head.set_vocab(torch.randperm(smollm2.config.vocab_size)[:8192])
    if kind == "dspark":
        torch.nn.init.normal_(drafter.markov.W2, std=0.05)
    path = save_drafter(drafter, tmp_path / "ckpt", "smollm2")
    target_gguf = default_gguf_path()
    out = export_gguf(path, tmp_path / f"{kind}.gguf", target_gguf, smollm2.path, "f16")
    prompts = [smollm2.tokenizer.encode_prompt(p) for p in
               ("Write a haiku about the sea.", "What is 17 times 23? Explain.", "List three uses of copper.")]
    bin_dir = find_bin_dir()
    with LlamaServer(bin_dir, target_gguf, threads=1, log_path=tmp_path / "plain.log") as plain:
        expected = [plain.complete(ids, 32).tokens for ids in prompts]
    with LlamaServer(bin_dir, target_gguf, out.llama_cli_args(target_gguf)[2:], threads=1,
                     log_path=tmp_path / "spec.log") as spec:
        runs = [spec.complete(ids, 32) for ids in prompts]
    assert [len(t) for t in expected] == [32] * 3
    assert [r.tokens for r in runs] == expected
    assert all(r.draft_n > 0 for r in runs)
