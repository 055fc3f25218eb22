"""Run the target in vLLM (pinned 0.32, CPU build) with one speculative configuration, and measure it.

What a configuration is (`VllmDrafter`): a name, the `speculative_config` vLLM gets (None for plain
decoding) and, for H-Spec, the `hf_overrides` that name its checkpoint. `parse_drafters` turns the
bench's `--drafters none,ngram,suffix,dflash=PATH,hspec[=PATH]` into them.
`open_llm` builds a `vllm.LLM` for the target's HF folder, `generate_greedy` runs one prompt at
temperature 0 and returns its token ids with the request's own spec-decode counters, and
`kv_capacity_tokens` reads vLLM's KV capacity from the engine's cache config.

Prompts are token ids (hspec's chat template applied by hspec's tokenizer), so vLLM and hspec's own
engine see the same ids. vLLM is imported inside the functions: this module imports without vLLM.

Settings for a shared CPU (docs/vllm.md): `cpu_environment` pins vLLM to one OpenMP thread without
binding, and a KV cache of `kv_cache_gib` GiB. `enforce_eager=True` loads in ~35 s instead of ~150 s.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The vLLM release this integration is written and tested against (scripts/install_vllm.sh installs it).
VLLM_VERSION = "0.32.0"
ALLOWED_DRAFTERS = ("none", "ngram", "suffix", "dflash=PATH", "dflash=random", "peagle=PATH", "peagle=random",
                    "hspec", "hspec=PATH", "hspec:P", "hspec@B", "hspec:P@B=PATH", "hspec:auto")
# `hspec:P`: each request keeps its leading drafts of confidence >= P; `hspec@B`: at most B drafts per step
# over the whole batch; `hspec:auto`: each request the length that pays most per step cost (`proposer.DraftLength`).
_HSPEC_NAME = re.compile(r"hspec(?::(?:(?P<auto>auto)|(?P<floor>[0-9.]+)))?(?:@(?P<budget>[0-9]+))?")
# vLLM's suffix decoding runs on arctic-inference's suffix tree, at the version vLLM 0.32 names.
SUFFIX_REQUIREMENT = "arctic-inference==0.1.1"
# `dflash=random`, `peagle=random`: a random-initialised hspec drafter of that kind (seed 0): exercises
# losslessness and KV cost, not tau.
RANDOM_WEIGHTS = "random"
# hspec kinds served through an export, by the vLLM method that serves them.
EXPORTED_KINDS = {"dflash": "dflash", "eagle3": "peagle"}


@dataclass(frozen=True)
class VllmDrafter:
    """One speculative configuration of vLLM."""

    name: str  # as given on the command line: none, ngram, dflash=PATH
    speculative_config: dict[str, Any] | None  # vLLM's speculative_config; None = plain decoding
    hf_overrides: dict[str, Any] | None = None  # H-Spec: {"hspec_drafter": PATH} (proposer.HF_OVERRIDE_KEY)


@dataclass(frozen=True)
class GreedyRun:
    """One prompt through one configuration."""

    token_ids: list[int]  # generated ids (prompt excluded)
    seconds: float  # wall time of the generate call
    num_drafts: int  # verify steps that carried drafts (vLLM's spec_decode_num_drafts)
    num_accepted: int  # draft tokens accepted over those steps


def ngram_config(k: int) -> dict[str, Any]:
    """vLLM's prompt-lookup speculation with K drafts, n-grams of 2..4 tokens (hspec's ngram defaults)."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def suffix_config(k: int) -> dict[str, Any]:
    """vLLM's suffix decoding with at most K drafts a step. It needs arctic-inference, which PyPI serves
    only as source (a C++ build); a clear error here beats vLLM's from inside its engine process."""
    import importlib.util

    if importlib.util.find_spec("arctic_inference") is None:
        raise ValueError(f"suffix decoding needs {SUFFIX_REQUIREMENT} in this environment (it builds from "
                         f"source: pip install '{SUFFIX_REQUIREMENT}', a few minutes with a C++ compiler)")
    return {"method": "suffix", "num_speculative_tokens": k}


def dflash_config(path: str | Path, k: int | None = None) -> dict[str, Any]:
    """vLLM's DFlash method on an exported drafter (`export_dflash_for_vllm`); K from its config if None."""
    if k is None:
        methods = json.loads((Path(path) / "config.json").read_text())["speculators_config"]["proposal_methods"]
        k = int(methods[0]["speculative_tokens"])
    return {"method": "dflash", "model": str(path), "num_speculative_tokens": k}


def peagle_config(path: str | Path, k: int | None = None) -> dict[str, Any]:
    """vLLM's parallel EAGLE-3 on an exported P-Eagle (`export_peagle_for_vllm`); K from its config if None."""
    if k is None:
        methods = json.loads((Path(path) / "config.json").read_text())["speculators_config"]["proposal_methods"]
        k = int(methods[0]["speculative_tokens"])
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k, "parallel_drafting": True}


def parse_drafters(text: str, k: int) -> list[VllmDrafter]:
    """`none,ngram,dflash=PATH` -> configurations, in order; `none` (plain) is added first if missing.

    Plain decoding is what every other configuration's output is compared with, so it always runs.
    """
    out: list[VllmDrafter] = []
    for item in (s.strip() for s in text.split(",")):
        name, _, value = item.partition("=")
        if name == "none" and not value:
            out.append(VllmDrafter("none", None))
        elif name == "ngram" and not value:
            out.append(VllmDrafter("ngram", ngram_config(k)))
        elif name == "suffix" and not value:
            out.append(VllmDrafter("suffix", suffix_config(k)))
        elif name == "dflash" and value:
            if value != RANDOM_WEIGHTS and not (Path(value) / "config.json").exists():
                raise ValueError(f"dflash={value}: no config.json there; give an hspec DFlash checkpoint or its "
                                 "vLLM export (`hspec.integrations.vllm.export`, docs/vllm.md)")
            out.append(VllmDrafter(item, {"method": "dflash", "model": value}))  # K: see `resolve_export`
        elif name == "peagle" and value:
            if value != RANDOM_WEIGHTS and not (Path(value) / "config.json").exists():
                raise ValueError(f"peagle={value}: no config.json there; give an hspec P-Eagle checkpoint or its "
                                 "vLLM export (`hspec.integrations.vllm.export`, docs/vllm.md)")
            out.append(VllmDrafter(item, {"method": "eagle3", "model": value, "parallel_drafting": True}))
        elif match := _HSPEC_NAME.fullmatch(name):
            if value and not (Path(value) / "config.json").exists():
                raise ValueError(f"{item}: no config.json there; give an hspec H-Spec checkpoint "
                                 "(`hspec train --drafter hspec`), or `hspec` alone for the shipped one")
            floor, budget = match["floor"], match["budget"]
            out.append(hspec_drafter(item, value or None, draft_budget=None if budget is None else int(budget),
                                     confidence_floor=None if floor is None else float(floor),
                                     adaptive=match["auto"] is not None))  # K: `resolve_hspec`
        else:
            raise ValueError(f"unknown drafter {item!r}; allowed: {', '.join(ALLOWED_DRAFTERS)}")
    if not any(d.speculative_config is None for d in out):
        out.insert(0, VllmDrafter("none", None))
    if len({d.name for d in out}) != len(out):
        raise ValueError(f"drafters must be distinct, got {text!r}")
    return out


def resolve_export(drafter: VllmDrafter, export_dir: Path, target_dir: Path) -> VllmDrafter:
    """A `dflash` or `peagle` configuration on a loadable export: an hspec checkpoint is exported into
    `export_dir` first (its own folder per source); K comes from the export's config. Other configurations
    are returned unchanged."""
    config = drafter.speculative_config
    if config is None or config["method"] not in EXPORTED_KINDS:
        return drafter
    from hspec.integrations.vllm.export import export_dflash_for_vllm, export_peagle_for_vllm, is_vllm_export

    kind = EXPORTED_KINDS[config["method"]]
    path = Path(config["model"])
    if not is_vllm_export(path):
        # One folder per source checkpoint: two checkpoints both named `drafter` (runs/X/drafter) must not
        # share an export, and the name can never be the source's own folder.
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        dst = export_dir / f"{kind}-{path.name}-{digest}"
        path = (export_dflash_for_vllm if kind == "dflash" else export_peagle_for_vllm)(path, dst, target_dir)
    return VllmDrafter(drafter.name, dflash_config(path) if kind == "dflash" else peagle_config(path))


def hspec_drafter(name: str, path: str | Path | None, k: int | None = None, draft_budget: int | None = None,
                  confidence_floor: float | None = None, adaptive: bool = False,
                  step_cost: str | None = None) -> VllmDrafter:
    """H-Spec through hspec's proposer (`proposer.HSpecProposer`): the checkpoint at `path`, or (None) the
    one shipped for the target; K = None until `resolve_hspec` reads the checkpoint's block size.
    `draft_budget`, `confidence_floor`, `adaptive` (`hspec:auto`, with `step_cost` "D,T,TS[,F]" or None:
    timed in the engine): the proposer's `DraftLength` settings (None / False: off)."""
    from hspec.drafters.step_cost import StepCost
    from hspec.integrations.vllm.proposer import DraftLength, hspec_config

    cost = None if step_cost is None else StepCost.parse(step_cost)
    DraftLength(k or 1, draft_budget, confidence_floor, adaptive, cost)  # bad values fail here, not in vLLM's worker
    config, overrides = hspec_config(k, path, draft_budget, confidence_floor, adaptive, step_cost)
    return VllmDrafter(name, config, overrides or None)


def hspec_checkpoint(drafter: VllmDrafter, target_name: str) -> Path:
    """The H-Spec checkpoint of an `hspec` configuration: its hf_overrides path, else the shipped drafter."""
    from hspec.integrations.vllm.proposer import HF_OVERRIDE_KEY
    from hspec.runtime import shipped_drafter_path

    path = (drafter.hf_overrides or {}).get(HF_OVERRIDE_KEY)
    return Path(path) if path else shipped_drafter_path("hspec", target_name)


def resolve_hspec(drafter: VllmDrafter, target_name: str, k: int | None = None) -> VllmDrafter:
    """An `hspec` configuration with its checkpoint path explicit and K set (default: the trained block
    size, the most the drafter drafts). Other configurations are returned unchanged."""
    from hspec.integrations.vllm.proposer import PROPOSER_CLASS

    config = drafter.speculative_config
    if config is None or config.get("model") != PROPOSER_CLASS:
        return drafter
    from hspec.drafters.checkpoint import read_checkpoint
    from hspec.integrations.vllm.proposer import HF_BUDGET_KEY, HF_COST_KEY, HF_FLOOR_KEY, HF_LENGTH_KEY

    path = hspec_checkpoint(drafter, target_name)
    max_draft_len = read_checkpoint(path).drafter_config.max_draft_len
    overrides = drafter.hf_overrides or {}
    return hspec_drafter(drafter.name, path, k or config.get("num_speculative_tokens") or max_draft_len,
                         overrides.get(HF_BUDGET_KEY), overrides.get(HF_FLOOR_KEY), HF_LENGTH_KEY in overrides,
                         overrides.get(HF_COST_KEY))


def cpu_environment(threads: int = 1, kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment for vLLM's CPU backend on a shared machine: `threads` OpenMP threads, no core binding."""
    return {
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # binding would pin every engine to the same cores
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),  # GiB of KV cache (default: a share of RAM)
    }


def open_llm(model_dir: str | Path, drafter: VllmDrafter, dtype: str = "float32", max_model_len: int = 1024,
             seed: int = 0, max_num_seqs: int = 1) -> Any:
    """A `vllm.LLM` for the target's HF folder with `drafter`'s speculative config, eager, batch up to
    `max_num_seqs` (1: the bench's batch-1 measurements), without prefix caching (a prompt sent twice,
    as a warm-up and again, would otherwise skip its second prefill, which hspec's engine never does)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    from vllm import LLM

    # Per-request spec-decode counters: vLLM's global metrics are shared by every LLM of one process.
    per_request = {"per_request_spec_decode_metrics": "summary"} if drafter.speculative_config else {}
    overrides = {"hf_overrides": drafter.hf_overrides} if drafter.hf_overrides else {}
    return LLM(str(model_dir), dtype=dtype, enforce_eager=True, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
               seed=seed, speculative_config=drafter.speculative_config, disable_log_stats=False,
               enable_prefix_caching=False, **per_request, **overrides)


def generate_greedy(llm: Any, prompt_ids: Sequence[int], max_new_tokens: int) -> GreedyRun:
    """One prompt (token ids) at temperature 0, with the request's own spec-decode counters."""
    (run,) = generate_greedy_batch(llm, [prompt_ids], max_new_tokens)
    return run


def generate_greedy_batch(llm: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[GreedyRun]:
    """Prompts (token ids) submitted together at temperature 0 (vLLM batches up to its max_num_seqs);
    per prompt its ids and spec-decode counters, `seconds` the wall time of the whole call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    runs = []
    for out in outs:
        completion = out.outputs[0]
        spec = getattr(completion, "spec_decode_metrics", None)
        stats = spec.to_dict() if spec is not None else {"num_spec_steps": 0, "num_accepted_draft_tokens": 0}
        runs.append(GreedyRun(list(completion.token_ids), seconds, int(stats["num_spec_steps"]),
                              int(stats["num_accepted_draft_tokens"])))
    return runs


def kv_capacity_tokens(llm: Any) -> int:
    """vLLM's KV-cache capacity in tokens: the blocks its engine allocated times the block size.

    What the drafter's own KV layers take (DFlash keeps one per drafter layer) is already subtracted.
    """
    cache = llm.llm_engine.vllm_config.cache_config
    if not cache.num_gpu_blocks:
        raise RuntimeError("vLLM reported no KV blocks (cache_config.num_gpu_blocks); is the engine up?")
    return int(cache.num_gpu_blocks) * int(cache.block_size)


def apply_environment(env: dict[str, str]) -> None:
    """Set `env` for vLLM's engine processes, which read it when they start (call before `open_llm`)."""
    os.environ.update(env)
