"""`hspec bench vllm`: the target served by vLLM (CPU build) with each drafter, against vLLM plain.

For every prompt (chat-templated by hspec's tokenizer, so every engine sees the same token ids), in
turn, so machine noise hits every row alike (every engine is opened and warmed up first):
1. each vLLM configuration (`--drafters`, plain always included) generates greedily;
2. hspec's own engine runs the matching drafter on the same ids (ngram -> hspec's ngram with the same
   K; dflash=PATH, peagle=PATH -> the hspec checkpoint the export came from, when it is still there; hspec[=PATH] -> the
   same H-Spec checkpoint, which vLLM runs through hspec's proposer), so tau can be compared engine
   against engine, then the `--hspec-methods` rows. Every engine has `--threads` CPU threads.

Per configuration it reports how many prompts' greedy outputs equal vLLM plain's (`outputs_equal_plain`;
exact in float32, a divergence rate in bfloat16), tau (mean accepted length: tokens per verify step,
bonus included), tokens/s over the generate calls, and vLLM's KV capacity in tokens.

Needs vLLM (`bash scripts/install_vllm.sh`); see docs/vllm.md. Legend: K drafts per step.
"""

from __future__ import annotations

import functools
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from hspec.drafters import PLAIN
from hspec.integrations.vllm import engine as vllm_engine
from hspec.provenance import provenance, provenance_markdown, write_results

# The `engine` of the rows hspec's own engine ran (the others: "vllm").
HSPEC_ENGINE = "hspec"
# vLLM's own proposers that an hspec kind drafts alike: vLLM's prompt lookup is hspec's n-gram (n = 2..4).
VLLM_COUNTERPARTS = {"ngram": "ngram"}


def read_prompts(prompts_file: str | None, num_prompts: int, data_dir: str | None = None) -> list[str]:
    """User messages: each line of `prompts_file` is {"prompt": "..."}; without a file, `num_prompts`
    evenly spaced Spec-Bench items (their first turn)."""
    if prompts_file is None:
        from hspec.data.tasks import load_task

        return [item.turns[0] for item in load_task("spec_bench", size=num_prompts, data_dir=data_dir).items]
    prompts = []
    for number, line in enumerate(Path(prompts_file).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f'{prompts_file}:{number}: each line must be {{"prompt": "..."}}, got {line[:80]!r}')
        prompts.append(row["prompt"])
    if not prompts:
        raise ValueError(f"{prompts_file}: no prompts")
    return prompts[:num_prompts] if num_prompts else prompts


def summarize(name: str, engine: str, runs: Sequence[vllm_engine.GreedyRun], plain: Sequence[list[int]],
              kv_capacity: int | None) -> dict[str, Any]:
    """One result row: equality with vLLM plain, tau, tokens/s, KV capacity."""
    tokens = sum(len(r.token_ids) for r in runs)
    drafts = sum(r.num_drafts for r in runs)
    accepted = sum(r.num_accepted for r in runs)
    return {
        "drafter": name,
        "engine": engine,
        "num_prompts": len(runs),
        "outputs_equal_plain": sum(r.token_ids == p for r, p in zip(runs, plain)),
        "tau": 1.0 + accepted / drafts if drafts else 1.0,
        "tokens_per_s": tokens / max(sum(r.seconds for r in runs), 1e-9),
        "num_tokens": tokens,
        "kv_capacity_tokens": kv_capacity,
    }


def hspec_runner(target: Any, kind: str, path: Path | None, K: int, max_new_tokens: int
                 ) -> Callable[[list[int]], vllm_engine.GreedyRun]:
    """hspec's own engine with drafter `kind` (K drafts per step): prompt ids -> its greedy run.

    EOS ids are the target's, as in vLLM, so both stop at the same token. tau counts only the steps
    that carried drafts, as vLLM's spec-decode counters do.
    """
    from hspec.decoding.generate import SpeculativeDecoder
    from hspec.runtime import build_drafter
    from hspec.sampling import SamplingParams

    drafter = build_drafter(kind, target, path)
    decoder = SpeculativeDecoder(target.model, drafter, max(K, 1), target.config.eos_token_ids)

    def run(ids: list[int]) -> vllm_engine.GreedyRun:
        start = time.perf_counter()
        out = decoder.generate([ids], SamplingParams(), max_new_tokens)
        seconds = time.perf_counter() - start
        seq = out.sequences[0]
        # Steps that carried drafts, as vLLM counts them (its n-gram proposes nothing without a match).
        drafted = [(a, d) for a, d in zip(seq.num_accepted, seq.num_drafted) if d > 0] if kind != PLAIN else []
        return vllm_engine.GreedyRun(list(seq.token_ids), seconds, len(drafted), sum(a for a, _ in drafted))
    return run


def hspec_engine_runs(target: Any, kind: str, path: Path | None, K: int, prompts: Sequence[list[int]],
                      max_new_tokens: int) -> list[vllm_engine.GreedyRun]:
    """The prompts one after another through `hspec_runner`."""
    run = hspec_runner(target, kind, path, K, max_new_tokens)
    return [run(ids) for ids in prompts]


def hspec_counterpart(drafter: vllm_engine.VllmDrafter, target_name: str) -> tuple[str, Path | None] | None:
    """The hspec drafter that matches a vLLM configuration, or None when there is none to run."""
    if drafter.speculative_config is None:
        return PLAIN, None
    method = drafter.speculative_config["method"]
    if method in VLLM_COUNTERPARTS:
        return VLLM_COUNTERPARTS[method], None
    if (kind := vllm_engine.exported_kind(drafter)) is not None:
        exported = json.loads((Path(drafter.speculative_config["model"]) / "config.json").read_text())
        source = Path(exported.get("hspec_source", {}).get("path", ""))
        return (kind, source) if (source / "config.json").exists() else None
    if method == "custom_class":  # the same cut (`hspec:P`, `hspec:auto`); hspec's engine has no per-batch budget
        from hspec.integrations.vllm.proposer import HF_FLOOR_KEY, HF_LENGTH_KEY

        overrides = drafter.hf_overrides or {}
        floor = overrides.get(HF_FLOOR_KEY)
        kind = "hspec" if floor is None else f"hspec:{floor:g}"
        if HF_LENGTH_KEY in overrides:
            kind = f"hspec:{overrides[HF_LENGTH_KEY]}"
        return kind, vllm_engine.hspec_checkpoint(drafter, target_name)
    return None


def materialize_random(drafter: vllm_engine.VllmDrafter, target: Any, root: Path) -> vllm_engine.VllmDrafter:
    """`dflash=random`, `peagle=random` -> a random-initialised hspec drafter of that kind (seed 0) saved
    under `root`; others unchanged."""
    config = drafter.speculative_config
    if config is None or config.get("model") != vllm_engine.RANDOM_WEIGHTS:
        return drafter
    kind = vllm_engine.exported_kind(drafter)
    assert kind is not None, "only an exported kind's configuration names random weights (parse_drafters)"
    import torch

    from hspec.drafters import create_drafter
    from hspec.drafters.checkpoint import save_drafter

    torch.manual_seed(0)
    model = create_drafter(kind, target.config, target_model=target.model)
    path = save_drafter(model, root / "hspec" / f"{kind}-random", target.name)
    return vllm_engine.VllmDrafter(drafter.name, {**config, "model": str(path)})


@dataclass(frozen=True)
class HspecSide:
    """hspec's own engine in the bench: its dtype, and drafters it runs without a vLLM counterpart."""

    dtype: str = "float32"  # float32 keeps the engine-against-engine tau comparison exact
    methods: tuple[str, ...] = ()  # e.g. ("hspec+ngram:0.4",): hspec-only rows, drafting K a step
    K: int = 7


def run_vllm_bench(target_name: str, drafters: str, prompts_file: str | None, num_prompts: int,
                   max_new_tokens: int, dtype: str, K: int, max_model_len: int, out_dir: str,
                   json_out: TextIO | None, data_dir: str | None = None, hspec_engine: bool = True,
                   hspec: HspecSide = HspecSide(), name: str | None = None, threads: int = 2) -> int:
    """`hspec bench vllm` (module docstring); DFlash exports live in a temporary folder removed at the end.
    `hspec`: the dtype and extra drafters of hspec's engine; `name`: the file stem (default vllm_<dtype>);
    `threads`: the CPU threads of every vLLM engine and of hspec's engine alike. `json_out`: print the rows there as
    JSON instead of writing `out_dir` (the command line's `--json` passes the real stdout of `console.json_stdout`,
    so vLLM's logs, which go to stdout, reach stderr instead)."""
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    with tempfile.TemporaryDirectory(prefix="hspec-vllm-export-") as root:
        return _run(target_name, drafters, prompts_file, num_prompts, max_new_tokens, dtype, K, max_model_len,
                    out_dir, json_out, data_dir, hspec_engine, Path(root), hspec, name, threads)


def _run(target_name: str, drafters: str, prompts_file: str | None, num_prompts: int, max_new_tokens: int,
         dtype: str, K: int, max_model_len: int, out_dir: str, json_out: TextIO | None, data_dir: str | None,
         hspec_engine: bool, export_root: Path, hspec: HspecSide, name: str | None, threads: int) -> int:
    import torch

    from hspec.models.loading import load_target

    configs = vllm_engine.parse_drafters(drafters, K)
    target = load_target(target_name, dtype=hspec.dtype)
    messages = read_prompts(prompts_file, num_prompts, data_dir)
    prompts = [target.tokenizer.encode_prompt(m) for m in messages]
    env = vllm_engine.cpu_environment(threads)
    vllm_engine.apply_environment(env)
    torch.set_num_threads(threads)  # hspec's engine runs in this process, with as many threads as vLLM's

    configs = [materialize_random(c, target, export_root) for c in configs]
    configs = [vllm_engine.resolve_export(c, export_root / "vllm", target.path) for c in configs]
    configs = [vllm_engine.resolve_hspec(c, target.name) for c in configs]  # K: the checkpoint's block size
    most_K = max([K, *(c.K for c in configs if c.speculative_config)])
    too_long = [i for i, p in enumerate(prompts) if len(p) + max_new_tokens + most_K + 1 > max_model_len]
    if too_long:
        raise ValueError(f"prompts {too_long} plus --max-new-tokens {max_new_tokens} exceed --max-model-len "
                         f"{max_model_len}; raise it or shorten them")

    # Every engine opened and warmed up (the first generate pays one-off costs), then the prompts in turn,
    # each through every engine: vLLM's configurations, then hspec's own engine (`hspec.dtype`) with the
    # matching drafters, for the tau comparison, and the drafters only hspec's engine runs.
    engines: dict[tuple[str, str], Callable[[list[int]], vllm_engine.GreedyRun]] = {}
    llms = {c.name: vllm_engine.open_llm(target.path, c, dtype, max_model_len) for c in configs}
    for config_name, llm in llms.items():
        engines[config_name, "vllm"] = functools.partial(vllm_engine.generate_greedy, llm,
                                                         max_new_tokens=max_new_tokens)
    if hspec_engine:
        for c in configs:
            counterpart = hspec_counterpart(c, target.name)
            if counterpart is not None:
                K_c = c.K if c.speculative_config else 0
                engines[c.name, HSPEC_ENGINE] = hspec_runner(target, *counterpart, K_c, max_new_tokens)
        for method in hspec.methods:
            engines[method, HSPEC_ENGINE] = hspec_runner(target, method, None, hspec.K, max_new_tokens)
    for llm in llms.values():
        vllm_engine.generate_greedy(llm, prompts[0], 4)
    for key, run in engines.items():
        if key[1] == HSPEC_ENGINE:
            run(prompts[0][:16])
    runs: dict[tuple[str, str], list[vllm_engine.GreedyRun]] = {key: [] for key in engines}
    for i, ids in enumerate(prompts):
        for key, run in engines.items():
            runs[key].append(run(ids))
        print(f"[bench vllm] prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{row} ({engine}) {r[-1].seconds:.2f} s" for (row, engine), r in runs.items()), flush=True)
    plain = [r.token_ids for r in runs[next(c.name for c in configs if c.speculative_config is None), "vllm"]]
    capacity = {config_name: vllm_engine.kv_capacity_tokens(llm) for config_name, llm in llms.items()}
    rows = [summarize(row, engine, r, plain, capacity[row] if engine == "vllm" else None)
            for (row, engine), r in runs.items()]
    del llms
    if json_out is not None:
        print(json.dumps(rows, indent=2), file=json_out)
        return 0
    settings = {"target": target.name, "drafters": drafters, "prompts": prompts_file or f"spec_bench[{num_prompts}]",
                "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "dtype": dtype, "K": K,
                "K_per_drafter": {c.name: c.K for c in configs
                                  if c.speculative_config},
                "max_model_len": max_model_len, "batch": 1, "enforce_eager": True, "vllm": vllm_version(),
                "hspec_dtype": target.model.dtype_name, "hspec_methods": list(hspec.methods), "hspec_k": hspec.K,
                "hspec_threads": torch.get_num_threads(), **env}
    command = (f"hspec bench vllm --drafters {drafters} " + (f"--prompts-file {prompts_file} " if prompts_file else
               f"--num-prompts {num_prompts} ") + f"--max-new-tokens {max_new_tokens} --dtype {dtype} --k {K}"
               f" --threads {threads}")
    if hspec != HspecSide():
        command += (f" --hspec-dtype {hspec.dtype} --hspec-k {hspec.K}"
                    + (f" --hspec-methods {','.join(hspec.methods)}" if hspec.methods else ""))
    command += f" --name {name}" if name else ""
    meta = provenance(command, settings)
    stem = name or f"vllm_{dtype}"
    json_path, md_path = write_results(Path(out_dir), stem, {"meta": meta, "rows": rows}, render_markdown(meta, rows))
    print(render_markdown(meta, rows))
    print(f"wrote {json_path} and {md_path}")
    return 0


def render_markdown(meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    plain = next((r["tokens_per_s"] for r in rows if r["drafter"] == PLAIN and r["engine"] == "vllm"), None)
    drafted = [r for r in rows if r["drafter"] != PLAIN and r["engine"] == "vllm"]
    fastest = max(drafted, key=lambda r: r["tokens_per_s"], default=None)  # vLLM's fastest drafter
    lines = ["# hspec bench vllm: drafters inside vLLM (batch 1, greedy)", "", provenance_markdown(meta),
             "| drafter | engine | outputs equal vLLM plain | tau | tokens/s | x vLLM plain | "
             f"x vLLM {fastest['drafter'] if fastest else 'drafted'} | KV capacity (tokens) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kv = "" if r["kv_capacity_tokens"] is None else f"{r['kv_capacity_tokens']:,}"
        lines.append(f"| {r['drafter']} | {r['engine']} | {r['outputs_equal_plain']}/{r['num_prompts']} | "
                     f"{r['tau']:.2f} | {r['tokens_per_s']:.1f} | {_ratio(r['tokens_per_s'], plain)} | "
                     f"{_ratio(r['tokens_per_s'], fastest['tokens_per_s'] if fastest else None)} | {kv} |")
    lines += ["", "tau: tokens per verify step (accepted drafts + the bonus token). tokens/s: generated tokens over "
              "the wall time of the generate calls (prefill included), one prompt at a time; the two ratio "
              "columns divide them by vLLM plain's and by the fastest vLLM drafter's, measured in the same run. "
              "`engine hspec` rows run hspec's own engine on the same token ids; their equality column compares "
              "with vLLM plain too."]
    if any(vllm_engine.runs_hspec_proposer(r["drafter"]) for r in rows):
        lines += ["", "hspec: H-Spec served by hspec's proposer (vLLM method `custom_class` + hspec's plugin), "
                  "K = the checkpoint's max_draft_len; it keeps no KV, so its KV capacity is plain's."]
    if any(r["drafter"] == "peagle=random" for r in rows):
        lines += ["", "peagle=random: an hspec P-Eagle with seed-0 random weights, exported as vLLM's parallel EAGLE-3 "
                  "(`eagle3` + `parallel_drafting`). Its rows show losslessness and the KV its 4 layers take."]
    if any(r["drafter"] == "dflash=random" for r in rows):
        lines += ["", "dflash=random: an hspec DFlash with seed-0 random weights, exported for vLLM. Its tau says "
                  "nothing about a trained DFlash; its rows show that output stays equal to plain and what "
                  "DFlash's context-KV layers take from vLLM's KV capacity."]
    return "\n".join(lines) + "\n"


def _ratio(tokens_per_s: float, reference: float | None) -> str:
    """tokens_per_s over a reference row's, as a table cell ('' without a reference)."""
    return f"{tokens_per_s / reference:.2f}x" if reference else ""


def vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        return "not installed"
