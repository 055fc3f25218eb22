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
# The forms `--drafters` takes for H-Spec, run by hspec's proposer inside vLLM.
HSPEC_FORMS = ("hspec", "hspec=PATH", "hspec:P", "hspec@B", "hspec:P@B=PATH", "hspec:auto")
# `hspec:P`: each request keeps its leading drafts of confidence >= P; `hspec@B`: at most B drafts per step
# over the whole batch; `hspec:auto`: each request the length that pays most per step cost (`proposer.DraftLength`).
_HSPEC_NAME = re.compile(r"hspec(?::(?:(?P<auto>auto)|(?P<floor>[0-9.]+)))?(?:@(?P<budget>[0-9]+))?")
# vLLM's suffix decoding runs on arctic-inference's suffix tree, at the version vLLM 0.32 names.
SUFFIX_REQUIREMENT = "arctic-inference==0.1.1"
# `dflash=random`, `peagle=random`: a random-initialised hspec drafter of that kind (seed 0): exercises
# losslessness and KV cost, not tau.
RANDOM_WEIGHTS = "random"


@dataclass(frozen=True)
class VllmDrafter:
    """One speculative configuration of vLLM."""

    name: str  # as given on the command line: none, ngram, dflash=PATH
    speculative_config: dict[str, Any] | None  # vLLM's speculative_config; None = plain decoding
    hf_overrides: dict[str, Any] | None = None  # H-Spec: {"hspec_drafter": PATH} (proposer.HF_OVERRIDE_KEY)

    @property
    def K(self) -> int:
        """Drafts per step: vLLM's `num_speculative_tokens` (a configuration with drafts, once resolved)."""
        if self.speculative_config is None:
            raise ValueError(f"{self.name}: plain decoding drafts nothing")
        return int(self.speculative_config["num_speculative_tokens"])


@dataclass(frozen=True)
class GreedyRun:
    """One prompt through one configuration."""

    token_ids: list[int]  # generated ids (prompt excluded)
    seconds: float  # wall time of the generate call
    num_drafts: int  # verify steps that carried drafts (vLLM's spec_decode_num_drafts)
    num_accepted: int  # draft tokens accepted over those steps


def ngram_config(K: int) -> dict[str, Any]:
    """vLLM's prompt-lookup speculation with K drafts, n-grams of 2..4 tokens (hspec's ngram defaults)."""
    return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def suffix_config(K: int) -> dict[str, Any]:
    """vLLM's suffix decoding with at most K drafts a step. It needs arctic-inference, which PyPI serves
    only as source (a C++ build); a clear error here beats vLLM's from inside its engine process."""
    import importlib.util

    if importlib.util.find_spec("arctic_inference") is None:
        raise ValueError(f"suffix decoding needs {SUFFIX_REQUIREMENT} in this environment (it builds from "
                         f"source: pip install '{SUFFIX_REQUIREMENT}', a few minutes with a C++ compiler)")
    return {"method": "suffix", "num_speculative_tokens": K}


# vLLM's own proposers by the name `--drafters` gives them: their speculative_config at K drafts a step.
VLLM_PROPOSERS = {"ngram": ngram_config, "suffix": suffix_config}
# What vLLM's speculative_config takes beside `method` and `model` for each method an hspec kind's export
# runs as (`Drafter.vllm_method`): P-Eagle's parallel drafting is vLLM's EAGLE-3 with `parallel_drafting`.
METHOD_OPTIONS: dict[str, dict[str, Any]] = {"eagle3": {"parallel_drafting": True}}


def exported_config(method: str, path: str | Path, K: int | None = None) -> dict[str, Any]:
    """vLLM's `method` on a drafter hspec exported for it (integrations/vllm/export.py); K from the export's
    config if None (vLLM's `num_speculative_tokens`, its Speculators config's `speculative_tokens`)."""
    if K is None:
        methods = json.loads((Path(path) / "config.json").read_text())["speculators_config"]["proposal_methods"]
        K = int(methods[0]["speculative_tokens"])
    return {"method": method, "model": str(path), "num_speculative_tokens": K, **METHOD_OPTIONS.get(method, {})}


def exported_kind(drafter: VllmDrafter) -> str | None:
    """The hspec kind whose export `drafter` serves (by the vLLM method the kind declares), else None."""
    from hspec.drafters import vllm_exported_kinds

    config = drafter.speculative_config
    return None if config is None else vllm_exported_kinds().get(config["method"])


def runs_hspec_proposer(name: str) -> bool:
    """Whether the configuration `--drafters` names `name` (`hspec`, `hspec:0.4=PATH`, ...) runs H-Spec
    through hspec's proposer inside vLLM."""
    return _HSPEC_NAME.fullmatch(name.partition("=")[0]) is not None


def parse_drafters(text: str, K: int) -> list[VllmDrafter]:
    """`none,ngram,dflash=PATH` -> configurations, in order; `none` (plain) is added first if missing.

    Plain decoding is what every other configuration's output is compared with, so it always runs. The
    kinds served through an export are those that declare a vLLM method (`Drafter.vllm_method`).
    """
    from hspec.drafters import PLAIN, vllm_exported_kinds

    exported = {kind: method for method, kind in vllm_exported_kinds().items()}
    out: list[VllmDrafter] = []
    for item in (s.strip() for s in text.split(",")):
        name, _, value = item.partition("=")
        if name == PLAIN and not value:
            out.append(VllmDrafter(PLAIN, None))
        elif name in VLLM_PROPOSERS and not value:
            out.append(VllmDrafter(name, VLLM_PROPOSERS[name](K)))
        elif name in exported and value:
            if value != RANDOM_WEIGHTS and not (Path(value) / "config.json").exists():
                raise ValueError(f"{item}: no config.json there; give an hspec {name} checkpoint or its vLLM "
                                 "export (`hspec.integrations.vllm.export`, docs/vllm.md)")
            method = exported[name]  # K: see `resolve_export`
            out.append(VllmDrafter(item, {"method": method, "model": value, **METHOD_OPTIONS.get(method, {})}))
        elif match := _HSPEC_NAME.fullmatch(name):
            if value and not (Path(value) / "config.json").exists():
                raise ValueError(f"{item}: no config.json there; give an hspec H-Spec checkpoint "
                                 "(`hspec train --drafter hspec`), or `hspec` alone for the shipped one")
            floor, budget = match["floor"], match["budget"]
            out.append(hspec_drafter(item, value or None, draft_budget=None if budget is None else int(budget),
                                     confidence_floor=None if floor is None else float(floor),
                                     adaptive=match["auto"] is not None))  # K: `resolve_hspec`
        else:
            allowed = [PLAIN, *VLLM_PROPOSERS, *(f"{kind}={form}" for kind in exported for form in ("PATH", "random")),
                       *HSPEC_FORMS]
            raise ValueError(f"unknown drafter {item!r}; allowed: {', '.join(allowed)}")
    if not any(d.speculative_config is None for d in out):
        out.insert(0, VllmDrafter(PLAIN, None))
    if len({d.name for d in out}) != len(out):
        raise ValueError(f"drafters must be distinct, got {text!r}")
    return out


def resolve_export(drafter: VllmDrafter, export_dir: Path, target_dir: Path) -> VllmDrafter:
    """A configuration that serves an hspec kind's export (`exported_kind`) on a loadable export: an hspec
    checkpoint is exported into `export_dir` first (its own folder per source); K comes from the export's
    config. Other configurations are returned unchanged."""
    kind = exported_kind(drafter)
    if kind is None:
        return drafter
    from hspec.integrations.vllm.export import export_for_vllm, is_vllm_export

    config = drafter.speculative_config
    assert config is not None  # an exported kind has a method
    path = Path(config["model"])
    if not is_vllm_export(path):
        # One folder per source checkpoint: two checkpoints both named `drafter` (runs/X/drafter) must not
        # share an export, and the name can never be the source's own folder.
        digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        dst = export_dir / f"{kind}-{path.name}-{digest}"
        path = export_for_vllm(path, dst, target_dir)
    return VllmDrafter(drafter.name, exported_config(config["method"], path))


def hspec_drafter(name: str, path: str | Path | None, K: int | None = None, draft_budget: int | None = None,
                  confidence_floor: float | None = None, adaptive: bool = False,
                  step_cost: str | None = None) -> VllmDrafter:
    """H-Spec through hspec's proposer (`proposer.HSpecProposer`): the checkpoint at `path`, or (None) the
    one shipped for the target; K = None until `resolve_hspec` reads the checkpoint's block size.
    `draft_budget`, `confidence_floor`, `adaptive` (`hspec:auto`, with `step_cost` "D,T,TS[,F]" or None:
    timed in the engine): the proposer's `DraftLength` settings (None / False: off)."""
    from hspec.drafters.step_cost import StepCost
    from hspec.integrations.vllm.proposer import DraftLength, hspec_config

    cost = None if step_cost is None else StepCost.parse(step_cost)
    DraftLength(K or 1, draft_budget, confidence_floor, adaptive, cost)  # bad values fail here, not in vLLM's worker
    config, overrides = hspec_config(K, path, draft_budget, confidence_floor, adaptive, step_cost)
    return VllmDrafter(name, config, overrides or None)


def hspec_checkpoint(drafter: VllmDrafter, target_name: str) -> Path:
    """The H-Spec checkpoint of an `hspec` configuration: its hf_overrides path, else the shipped drafter."""
    from hspec.integrations.vllm.proposer import HF_OVERRIDE_KEY
    from hspec.runtime import shipped_drafter_path

    path = (drafter.hf_overrides or {}).get(HF_OVERRIDE_KEY)
    return Path(path) if path else shipped_drafter_path("hspec", target_name)


def resolve_hspec(drafter: VllmDrafter, target_name: str, K: int | None = None) -> VllmDrafter:
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
    return hspec_drafter(drafter.name, path, K or config.get("num_speculative_tokens") or max_draft_len,
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
