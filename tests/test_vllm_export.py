"""The vLLM export of DFlash checkpoints and the `bench vllm` plumbing that needs no vLLM (runs everywhere).

The end-to-end checks inside vLLM are in test_vllm_engine.py (marker `vllm`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from hspec.bench.vllm import read_prompts, render_markdown, summarize
from hspec.drafters import create_drafter
from hspec.drafters.checkpoint import save_drafter
from hspec.drafters.dflash import DFlashConfig
from hspec.drafters.peagle import PEagleConfig
from hspec.integrations.vllm.engine import GreedyRun, parse_drafters, resolve_export
from hspec.integrations.vllm.export import (
    MASK_EMBEDDING_FILE,
    draft_to_target_offsets,
    export_dflash_for_vllm,
    export_peagle_for_vllm,
    is_vllm_export,
    pick_mask_token_id,
    vllm_weight_name,
)
from hspec.integrations.vllm.plugin import samples_from_anchor


@pytest.fixture()
def dflash_checkpoint(tiny_target, tmp_path):
    """A random DFlash drafter for the tiny target with a shuffled draft vocabulary, saved by hspec."""
    torch.manual_seed(0)
    config = DFlashConfig.from_target("dflash", tiny_target.config, draft_vocab_size=48)
    drafter = create_drafter("dflash", tiny_target.config, target_model=tiny_target.model, config=config)
    ids = torch.randperm(tiny_target.config.vocab_size)[:48]
    drafter.head.set_vocab(ids)
    return save_drafter(drafter, tmp_path / "hspec_dflash", "tiny"), drafter, ids


def test_weight_names_flatten_qkv_and_drop_what_is_exported_apart():
    assert vllm_weight_name("layers.3.self_attn.qkv.q_proj.weight") == "layers.3.self_attn.q_proj.weight"
    assert vllm_weight_name("layers.0.self_attn.qkv.k_norm.weight") == "layers.0.self_attn.k_norm.weight"
    assert vllm_weight_name("layers.0.self_attn.o_proj.weight") == "layers.0.self_attn.o_proj.weight"
    assert vllm_weight_name("fc.weight") == "fc.weight"
    assert vllm_weight_name("mask_embedding") is None
    assert vllm_weight_name("head.draft_vocab_ids") is None


def test_d2t_offsets_map_draft_index_to_target_id():
    ids = torch.tensor([3, 5, 6, 40])
    d2t = draft_to_target_offsets(ids)
    assert torch.equal(torch.arange(4) + d2t, ids)  # vLLM: target id = index + d2t[index]
    with pytest.raises(ValueError, match=r"\(Vp,\)"):
        draft_to_target_offsets(ids[None])


@pytest.mark.parametrize("kind", ["dflash", "peagle"])
def test_export_replaces_only_an_earlier_export(kind, tiny_target, tiny_dirs, tmp_path):
    """The export replaces its destination whole: an earlier export may go; an hspec checkpoint, a model folder or
    a folder of notes may not."""
    torch.manual_seed(0)
    config_class = DFlashConfig if kind == "dflash" else PEagleConfig
    config = config_class.from_target(kind, tiny_target.config, draft_vocab_size=48)
    drafter = create_drafter(kind, tiny_target.config, target_model=tiny_target.model, config=config)
    drafter.head.set_vocab(torch.randperm(tiny_target.config.vocab_size)[:48])
    src = save_drafter(drafter, tmp_path / "hspec_ckpt", "tiny")
    export = export_dflash_for_vllm if kind == "dflash" else export_peagle_for_vllm
    out = export(src, tmp_path / "vllm", tiny_dirs["llama"], mask_token_id=5)
    assert export(src, out, tiny_dirs["llama"], mask_token_id=6) == out  # an earlier export: replaced
    assert json.loads((out / "config.json").read_text())["mask_token_id"] == 6
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    for dst in (src, tiny_dirs["llama"], notes):
        before = sorted(p.name for p in dst.iterdir())
        with pytest.raises(FileExistsError, match=f"refusing to replace {dst}: it exists and is not an earlier"):
            export(src, dst, tiny_dirs["llama"], mask_token_id=5)
        assert sorted(p.name for p in dst.iterdir()) == before


def test_export_layout_matches_what_vllm_dflash_loads(dflash_checkpoint, tiny_dirs, tmp_path):
    path, drafter, ids = dflash_checkpoint
    out = export_dflash_for_vllm(path, tmp_path / "vllm", tiny_dirs["llama"], mask_token_id=5)
    assert is_vllm_export(out) and not is_vllm_export(path)
    tensors = load_file(str(out / "model.safetensors"))
    own = drafter.drafter_state_dict()
    # 1. every layer weight under vLLM's flat name, unchanged
    for name, value in own.items():
        flat = vllm_weight_name(name)
        if flat is not None:
            assert torch.equal(tensors[flat], value), name
    assert not any(".qkv." in n for n in tensors)
    # 2. the draft vocabulary: sorted target ids, LM head rows of those ids, d2t offsets
    sorted_ids = ids.sort().values
    assert torch.equal(torch.arange(48) + tensors["d2t"], sorted_ids)
    target_head = load_file(str(tiny_dirs["llama"] / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(tensors["lm_head.weight"], target_head[sorted_ids])
    # 3. MASK: an id inside the target's table, the learned embedding beside it
    mask = torch.load(out / MASK_EMBEDDING_FILE, weights_only=True)
    assert mask["mask_token_id"] == 5 and torch.equal(mask["embedding"], own["mask_embedding"])
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["mask_token_id"] == 5
    assert config["aux_hidden_state_layer_ids"] == list(drafter.config.target_layers)
    assert config["draft_vocab_size"] == 48
    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert k == drafter.config.max_draft_len - 1  # vLLM puts the anchor slot in front of K MASK slots


def test_export_refuses_bad_input(dflash_checkpoint, tiny_target, tiny_dirs, tmp_path):
    path, drafter, _ = dflash_checkpoint
    with pytest.raises(ValueError, match=r"K \(vLLM's num_speculative_tokens\) must be in 1.."):
        export_dflash_for_vllm(path, tmp_path / "a", tiny_dirs["llama"], K=0, mask_token_id=5)
    with pytest.raises(ValueError, match="mask_token_id must be a target id"):
        export_dflash_for_vllm(path, tmp_path / "b", tiny_dirs["llama"], mask_token_id=10_000)
    hspec_drafter = create_drafter("hspec", tiny_target.config, target_model=tiny_target.model)
    hspec_path = save_drafter(hspec_drafter, tmp_path / "hspec_ckpt", "tiny")
    with pytest.raises(ValueError, match="takes 'dflash'"):
        export_dflash_for_vllm(hspec_path, tmp_path / "c", tiny_dirs["llama"], mask_token_id=5)
    with pytest.raises(ValueError, match="takes 'peagle'"):
        export_peagle_for_vllm(hspec_path, tmp_path / "d", tiny_dirs["llama"], mask_token_id=5)


def test_peagle_export_layout_matches_what_vllm_parallel_eagle3_loads(tiny_target, tiny_dirs, tmp_path):
    torch.manual_seed(0)
    drafter = create_drafter("peagle", tiny_target.config, target_model=tiny_target.model,
                             config=PEagleConfig.from_target("peagle", tiny_target.config, draft_vocab_size=48))
    ids = torch.randperm(tiny_target.config.vocab_size)[:48]
    drafter.head.set_vocab(ids)
    path = save_drafter(drafter, tmp_path / "hspec_peagle", "tiny")
    out = export_peagle_for_vllm(path, tmp_path / "vllm", tiny_dirs["llama"], mask_token_id=5)
    assert is_vllm_export(out)
    tensors = load_file(str(out / "model.safetensors"))
    own = drafter.drafter_state_dict()
    for name, value in own.items():
        flat = vllm_weight_name(name)
        if flat is not None and name != "mask_hidden":
            assert torch.equal(tensors[flat], value), name
    assert torch.equal(tensors["mask_hidden"], own["mask_hidden"])  # (n_sel*H,), before fc as in vLLM
    target = load_file(str(tiny_dirs["llama"] / "model.safetensors"))
    sorted_ids = ids.sort().values
    assert torch.equal(torch.arange(48) + tensors["d2t"], sorted_ids)
    assert torch.equal(tensors["lm_head.weight"], target["lm_head.weight"][sorted_ids])
    # The MASK row of the drafter's own table is hspec's learned MASK embedding; every other row the target's.
    embed = tensors["embed_tokens.weight"]
    assert torch.equal(embed[5], own["mask_embedding"])
    keep = torch.arange(embed.shape[0]) != 5
    assert torch.equal(embed[keep], target["model.embed_tokens.weight"][keep])
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == 5
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    assert config["transformer_layer_config"]["num_hidden_layers"] == drafter.config.num_layers
    assert config["eagle_aux_hidden_state_layer_ids"] == list(drafter.config.target_layers)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafter.config.max_draft_len
    target_dir = tmp_path / "target"  # the on-the-fly export picks MASK from the target's tokenizer.json
    shutil.copytree(tiny_dirs["llama"], target_dir)
    added = [{"id": i, "content": f"<s{i}>", "special": True} for i in (0, 1, 2)]
    (target_dir / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    resolved = resolve_export(parse_drafters(f"peagle={path}", 5)[1], tmp_path / "exports", target_dir)
    model = Path(resolved.speculative_config.pop("model"))
    assert model.parent == tmp_path / "exports" and model.name.startswith(f"peagle-{path.name}-")
    assert is_vllm_export(model)
    assert resolved.speculative_config == {"method": "eagle3", "num_speculative_tokens": drafter.config.max_draft_len,
                                           "parallel_drafting": True}


def test_mask_token_is_the_last_special_token_that_is_not_bos_or_eos(tmp_path):
    added = [{"id": i, "content": f"<s{i}>", "special": True} for i in (0, 1, 2, 7)]
    added.append({"id": 9, "content": "word", "special": False})
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    assert pick_mask_token_id(tmp_path, {1, 2}) == 7
    with pytest.raises(ValueError, match="no special token outside"):
        pick_mask_token_id(tmp_path, {0, 1, 2, 7})


def test_parse_drafters_adds_plain_and_names_what_is_allowed(dflash_checkpoint, tiny_dirs, tmp_path):
    path, _, _ = dflash_checkpoint
    names = [d.name for d in parse_drafters("ngram", 5)]
    assert names == ["none", "ngram"]
    assert parse_drafters("dflash=random", 5)[1].speculative_config == {"method": "dflash", "model": "random"}
    configs = parse_drafters(f"none,dflash={path}", 5)
    assert configs[0].speculative_config is None
    # An hspec checkpoint is exported on the fly; K then comes from the export.
    target_dir = tmp_path / "target"
    shutil.copytree(tiny_dirs["llama"], target_dir)
    added = [{"id": i, "content": f"<s{i}>", "special": True} for i in (0, 1, 2)]
    (target_dir / "tokenizer.json").write_text(json.dumps({"added_tokens": added}))
    resolved = resolve_export(configs[1], tmp_path / "exports", target_dir)
    assert is_vllm_export(resolved.speculative_config["model"])
    assert resolved.speculative_config["num_speculative_tokens"] == 6  # block size 7 - the anchor slot
    assert resolve_export(configs[0], tmp_path / "exports", target_dir) is configs[0]
    before = sorted(p.name for p in path.iterdir())
    beside = resolve_export(configs[1], path.parent, target_dir)  # exporting next to its own source
    assert Path(beside.speculative_config["model"]).resolve() != path.resolve()  # never over what it reads
    assert sorted(p.name for p in path.iterdir()) == before and not is_vllm_export(path)
    twin = tmp_path / "other" / path.name  # another checkpoint with the same folder name (runs/X/drafter)
    shutil.copytree(path, twin)
    other = resolve_export(parse_drafters(f"dflash={twin}", 5)[1], tmp_path / "exports", target_dir)
    assert other.speculative_config["model"] != resolved.speculative_config["model"]  # one export each
    assert is_vllm_export(resolved.speculative_config["model"]) and is_vllm_export(other.speculative_config["model"])
    for bad, match in (("medusa", "unknown drafter 'medusa'; allowed"), ("dflash=/nowhere", "no config.json"),
                       ("ngram,ngram", "distinct"), ("hspec=/nowhere", "no config.json")):
        with pytest.raises(ValueError, match=match):
            parse_drafters(bad, 5)


def test_suffix_needs_arctic_inference_and_says_how_to_get_it(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "arctic_inference" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"suffix decoding needs arctic-inference==0\.1\.1.*builds from source"):
        parse_drafters("suffix", 5)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert parse_drafters("suffix", 4)[1].speculative_config == {"method": "suffix", "num_speculative_tokens": 4}


def test_hspec_drafter_names_its_checkpoint_and_takes_k_from_it(tiny_target, tmp_path):
    """`hspec` -> vLLM's custom_class method on hspec's proposer, the checkpoint passed as hf_overrides."""
    from hspec.integrations.vllm.engine import resolve_hspec
    from hspec.integrations.vllm.proposer import HF_OVERRIDE_KEY, PROPOSER_CLASS
    from hspec.runtime import shipped_drafter_path

    path = save_drafter(create_drafter("hspec", tiny_target.config, target_model=tiny_target.model),
                        tmp_path / "hspec_ckpt", "tiny")
    plain, shipped, own = parse_drafters(f"hspec,hspec={path}", 5)
    assert plain.speculative_config is None
    assert shipped.speculative_config == {"method": "custom_class", "model": PROPOSER_CLASS}
    assert shipped.hf_overrides is None and own.hf_overrides == {HF_OVERRIDE_KEY: str(path)}
    resolved = resolve_hspec(shipped, "SmolLM2-135M-Instruct")  # the drafter shipped with hspec
    assert resolved.hf_overrides == {HF_OVERRIDE_KEY: str(shipped_drafter_path("hspec", "SmolLM2-135M-Instruct"))}
    assert resolved.speculative_config["num_speculative_tokens"] == 7  # its max_draft_len
    assert resolve_hspec(own, "tiny", K=3).speculative_config["num_speculative_tokens"] == 3
    assert resolve_hspec(plain, "tiny") is plain


def test_hspec_with_a_floor_and_a_budget_keeps_them_through_resolve_and_in_hspecs_engine(tiny_target, tmp_path):
    """`hspec:P@B[=PATH]` -> the proposer's confidence floor P and draft budget B, as hf_overrides."""
    from hspec.bench.vllm import hspec_counterpart
    from hspec.integrations.vllm.engine import resolve_hspec
    from hspec.integrations.vllm.proposer import HF_BUDGET_KEY, HF_FLOOR_KEY, HF_OVERRIDE_KEY

    path = save_drafter(create_drafter("hspec", tiny_target.config, target_model=tiny_target.model),
                        tmp_path / "hspec_ckpt", "tiny")
    _, cut, budget = parse_drafters(f"hspec:0.4={path},hspec@64", 5)
    assert cut.name == f"hspec:0.4={path}" and cut.hf_overrides == {HF_OVERRIDE_KEY: str(path), HF_FLOOR_KEY: 0.4}
    assert budget.hf_overrides == {HF_BUDGET_KEY: 64}
    resolved = resolve_hspec(cut, "tiny", K=3)
    assert resolved.hf_overrides[HF_FLOOR_KEY] == 0.4 and resolved.speculative_config["num_speculative_tokens"] == 3
    assert hspec_counterpart(resolved, "tiny") == ("hspec:0.4", path)  # hspec's engine runs the same cut
    assert resolve_hspec(budget, "SmolLM2-135M-Instruct").hf_overrides[HF_BUDGET_KEY] == 64
    for bad, match in (("hspec:1.5", r"must be in \[0, 1\)"), ("hspec@x", "unknown drafter 'hspec@x'")):
        with pytest.raises(ValueError, match=match):
            parse_drafters(bad, 5)


def test_prompts_file_lines_must_hold_a_prompt(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert read_prompts(str(good), 0) == ["a", "b"]
    assert read_prompts(str(good), 1) == ["a"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: each line must be"):
        read_prompts(str(bad), 0)


def test_summary_counts_equal_outputs_and_tau():
    runs = [GreedyRun([1, 2, 3], 1.0, num_drafts=2, num_accepted=3), GreedyRun([1, 2, 4], 1.0, 1, 0)]
    row = summarize("ngram", "vllm", runs, plain=[[1, 2, 3], [1, 2, 3]], kv_capacity=100)
    assert row["outputs_equal_plain"] == 1
    assert row["tau"] == pytest.approx(1 + 3 / 3)
    assert row["tokens_per_s"] == pytest.approx(3.0)
    plain = summarize("none", "vllm", [GreedyRun([1, 2, 3], 1.0, 0, 0)], [[1, 2, 3]], 5)
    assert plain["tau"] == 1.0 and plain["outputs_equal_plain"] == 1


def test_the_table_divides_tokens_per_s_by_vllm_plain_and_by_its_fastest_drafter():
    def row(drafter, engine, seconds):
        return summarize(drafter, engine, [GreedyRun([1, 2, 3, 4], seconds, 1, 1)], [[1, 2, 3, 4]], None)

    rows = [row("none", "vllm", 2.0), row("ngram", "vllm", 1.0), row("suffix", "vllm", 1.6),
            row("none", "hspec", 0.5)]
    meta = {"command": "test", "date": "-", "commit": "-", "settings": {},
            "machine": {"cuda": None, "processor": "x", "cpu_count": 1, "torch_threads": 1, "platform": "p",
                        "torch": "t"}}
    text = render_markdown(meta, rows)
    assert "| x vLLM plain | x vLLM ngram |" in text
    assert "| ngram | vllm | 1/1 | 2.00 | 4.0 | 2.00x | 1.00x |" in text
    assert "| none | hspec | 1/1 | 2.00 | 8.0 | 4.00x | 2.00x |" in text
    assert "| x vLLM plain | x vLLM drafted |" in render_markdown(meta, rows[:1])


def test_plugin_acts_only_on_drafters_that_sample_from_the_anchor():
    assert samples_from_anchor(SimpleNamespace(dflash_config={"sample_from_anchor": True}))
    assert not samples_from_anchor(SimpleNamespace(dflash_config={"sample_from_anchor": False}))
    assert not samples_from_anchor(SimpleNamespace(dflash_config=None))  # vLLM's own DFlash checkpoints
    assert not samples_from_anchor(SimpleNamespace())


def test_bench_vllm_takes_hspecs_dtype_and_its_own_drafters():
    from hspec.cli import build_parser

    args = build_parser().parse_args(["bench", "vllm", "--drafters", "none,ngram", "--hspec-dtype", "int8",
                                      "--hspec-methods", "hspec+ngram:0.4", "--hspec-k", "3", "--name", "race"])
    assert (args.hspec_dtype, args.hspec_methods, args.hspec_k, args.name) == ("int8", "hspec+ngram:0.4", 3, "race")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "vllm", "--hspec-dtype", "float16"])
