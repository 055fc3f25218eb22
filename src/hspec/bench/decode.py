"""`hspec bench decode`: plain decoding side by side, and what a verify costs, per dtype.

1. Plain-decode time per token after the prefill (EOS ignored so every runtime emits exactly N) on the
   same prompts (their first `max_prompt_tokens` tokens), interleaved prompt by prompt so machine noise
   hits every column alike:
   - hspec in each dtype of `--dtypes` (the `--drafter none` path of `hspec generate`);
   - hspec float32 with q/k/v and gate/up as separate matmuls (the runtime before
     `models.weight_layout.fuse_projections`), so the gain of stacking is measured in the same run;
   - hspec bfloat16 on F.linear's plain weights (without `models.formats.floating`'s prepacked copies), when
     bfloat16 is among the dtypes, for the gain of oneDNN's prepacked weights;
   - hspec in the last row-invariant dtype of `--dtypes` (int4 by default) with its decoder layers run by
     Python rather than the native decoder stack (`models.native`), for that stack's gain;
   - hspec in each weight-only dtype (int8, int4) on torch's products, F.rms_norm and the row-invariant
     Python attention rather than hspec's kernels (`models/cpu_kernels.cpp`), where hspec's run, for their
     gain; its verify cost is measured too;
   - transformers on the same weights (float32): its model called token by token with its own KV
     cache (`DynamicCache`), the loop `generate` runs without the logits processors;
   - llama.cpp on the embedded target's own GGUF (Q4_1 for SmolLM2), greedy, with the same thread count:
     its own `llama-server` when scripts/build_llama_cpp.sh built it (`integrations.llama_cpp.binaries`;
     decode and prefill then read llama.cpp's own `predicted_ms` / `prompt_ms`, no Python in the loop),
     else through `llama-cpp-python` when it is installed (`pip install 'hspec[bench]'`; it compiles
     llama.cpp for this CPU), left out, with a warning naming the build that avoids it, when that build
     crashes on this CPU (`llama_cpp_crash`);
   - vLLM's CPU build when it is installed (`scripts/install_vllm.sh`, docs/vllm.md), bf16 (its fastest
     dtype here), eager, batch 1, no prefix caching, the same thread count. Its engine offers no clock
     between the prefill and the first decode step, so its decode time is a generate of N tokens minus
     a generate of 1 token on the same prompt, and its prefill time is the generate of 1 token.
   Reported in ms/token and as ratios to hspec float32 within each prompt.
2. Per dtype: the time of a (K+1)-token target forward (a verify) over a 1-token decode at the same
   context, K = 3, 7, 15, interleaved. Speculation pays only when this ratio stays small.
3. Per dtype: how often an 8-token forward picks a different argmax than 1-token decoding at the same
   position (teacher-forced on the plain greedy output): where that happens, greedy speculative output
   can part from plain output of the same dtype at a near-tie (docs/fast-path.md).
4. Prefill: the time of one forward over a prompt of P tokens (`--prefill-tokens`, the Spec-Bench
   prompts' tokens run together and cut to P) in every runtime of 1., interleaved. What a user waits
   before the first token, and what a served prompt costs on top of its decode.

Speculative decoding inside vLLM, against hspec's engine on the same prompts, is `hspec bench vllm`.
"""

from __future__ import annotations

import copy
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hspec.cache.paged_pool import pages_for
from hspec.data.tasks import load_task
from hspec.decoding.generate import SpeculativeDecoder
from hspec.drafters import create_drafter
from hspec.models.dtype import KERNEL_ONLY_DTYPES, dtype_name, quantized_weights, resolve_dtype
from hspec.models.formats.store import drop_packed
from hspec.models.layers import QKVProjection, SwiGLU
from hspec.models.llama import TargetModel
from hspec.models.loading import Target, build_model, default_gguf_path, load_target, read_state_dict
from hspec.provenance import provenance, provenance_markdown, write_results
from hspec.sampling import SamplingParams

VERIFY_KS = (3, 7, 15)
PREFILL_TOKENS = (128, 512)
UNFUSED = "float32-unfused"
UNPACKED = "bfloat16-unpacked"
PYTHON_LAYERS = "-python-layers"  # suffix of the dtype whose layers run without the native stack
TORCH_KERNELS = "-torch-kernels"  # suffix of a weight-only dtype on torch's kernels rather than hspec's
TRANSFORMERS = "transformers-float32"
LLAMA_CPP = "llama.cpp"
VLLM = "vllm-bfloat16"


def run_decode_bench(target_name: str, num_prompts: int, max_new_tokens: int, repeats: int, out_dir: str,
                     data_dir: str | None = None, dtypes: Sequence[str] = ("float32", "bfloat16", "int8", "int4"),
                     transformers: bool = True, max_prompt_tokens: int = 128, threads: int = 1,
                     prefill_tokens: Sequence[int] = PREFILL_TOKENS) -> int:
    """Write <out_dir>/decode_cpu.{json,md} (decode_gpu on a CUDA target). `dtypes` are `--dtype` names
    (auto resolves to this machine's choice); float32 always runs, as the reference column. `threads`
    sets torch's CPU threads for the run (0 keeps torch's default); `prefill_tokens`: the prompt lengths
    of part 4."""
    if max_new_tokens < 2:
        raise ValueError(f"--max-new-tokens must be >= 2 (the first token comes from the prefill), "
                         f"got {max_new_tokens}")
    if any(n < 1 for n in prefill_tokens):
        raise ValueError(f"--prefill-tokens must be positive, got {list(prefill_tokens)}")
    if threads:
        torch.set_num_threads(threads)
    resolved = [d if quantized_weights(d) else dtype_name(resolve_dtype(d)) for d in dtypes]
    names = list(dict.fromkeys(["float32", *resolved]))
    base = load_target(target_name, dtype=torch.float32)
    targets = {"float32": base}
    state = read_state_dict(base.path)
    for name in names[1:]:
        targets[name] = Target(base.name, base.path, base.config, build_model(base.config, state, name, "cpu"),
                               base.tokenizer)
    items = load_task("spec_bench", size=num_prompts, data_dir=data_dir).items  # data_dir: --data-dir
    prompts = [base.tokenizer.encode_prompt(item.turns[0])[:max_prompt_tokens] for item in items]
    long_prompt = prefill_prompt(base, max(prefill_tokens, default=0), data_dir)
    runners: dict[str, Runner] = {name: _hspec_runner(t.model, max_new_tokens) for name, t in targets.items()}
    runners[UNFUSED] = _hspec_runner(unfused_copy(base.model), max_new_tokens)
    if "bfloat16" in targets:
        unpacked = build_model(base.config, state, "bfloat16", "cpu")
        drop_packed(unpacked)
        runners[UNPACKED] = _hspec_runner(unpacked, max_new_tokens)
    native = [name for name in names if targets[name].model.native is not None]
    if native:
        python_layers = build_model(base.config, state, native[-1], "cpu", native=False)
        runners[native[-1] + PYTHON_LAYERS] = _hspec_runner(python_layers, max_new_tokens)
    verified = {name: t.model for name, t in targets.items()}  # the models whose verify cost part 2 measures
    for name in names:
        if quantized_weights(name) and name not in KERNEL_ONLY_DTYPES and targets[name].model.norm.kernel:
            verified[name + TORCH_KERNELS] = build_model(base.config, state, name, "cpu", kernels=False)
            runners[name + TORCH_KERNELS] = _hspec_runner(verified[name + TORCH_KERNELS], max_new_tokens)
    if transformers:
        runners[TRANSFORMERS] = _transformers_runner(base, max_new_tokens)
    llama_cpp = _llama_cpp_runner(target_name, max_new_tokens, torch.get_num_threads())
    if llama_cpp is not None:
        runners[LLAMA_CPP] = llama_cpp
    vllm = _vllm_runner(base, max_new_tokens, max(prefill_tokens, default=0), torch.get_num_threads())
    if vllm is not None:
        runners[VLLM] = vllm

    ms: dict[str, list[float]] = {name: [] for name in runners}
    with torch.inference_mode():
        for runner in runners.values():  # warm-up
            runner.decode(prompts[0][:16])
        for r in range(repeats):
            for i, ids in enumerate(prompts):
                for name, runner in runners.items():
                    ms[name].append(1000 * runner.decode(ids) / (max_new_tokens - 1))
                print(f"[decode] round {r + 1}/{repeats} prompt {i + 1}/{len(prompts)}: "
                      + ", ".join(f"{name} {v[-1]:.1f}" for name, v in ms.items()) + " ms/token", flush=True)
        verify = {name: verify_costs(model, prompts[0], repeats * 5) for name, model in verified.items()}
        flips = {name: argmax_flips(t.model, prompts, max_new_tokens) for name, t in targets.items()}
        prefill = prefill_costs(runners, long_prompt, prefill_tokens, repeats + 1)

    device = "gpu" if base.model.embed_tokens.weight.is_cuda else "cpu"
    command = (f"hspec bench decode --num-prompts {num_prompts} --max-new-tokens {max_new_tokens} "
               f"--repeats {repeats} --max-prompt-tokens {max_prompt_tokens} --threads {threads} "
               f"--dtypes {','.join(dtypes)} --prefill-tokens {','.join(map(str, prefill_tokens))}"
               + ("" if transformers else " --no-transformers")
               + ("" if data_dir is None else f" --data-dir {data_dir}"))
    payload = {
        "provenance": provenance(command, {
            "target": base.name, "dtypes": names, "auto_dtype": dtype_name(resolve_dtype("auto")),
            "prompts": "spec_bench subset", "num_prompts": num_prompts, "max_prompt_tokens": max_prompt_tokens,
            "prompt_lengths": [len(p) for p in prompts], "max_new_tokens": max_new_tokens,
            "repeats": repeats, "threads": torch.get_num_threads(), "prefill_tokens": list(prefill_tokens)}),
        "plain_decode_ms_per_token": {name: summary(v) for name, v in ms.items()},
        "plain_decode_ratio_to_float32": {name: summary([a / b for a, b in zip(v, ms["float32"])])
                                          for name, v in ms.items() if name != "float32"},
        "verify_over_decode": {name: {str(k): summary(v) for k, v in per_k.items()} for name, per_k in verify.items()},
        "argmax_flips_8_token_vs_1_token": flips,
        "prefill_ms": {name: {str(n): summary(v) for n, v in per_n.items()} for name, per_n in prefill.items()},
        "goals": "plain decode >= 2x the tokens/s of the runtime before the fast path; an 8-token verify "
                 "(K = 7) <= 1.3x a 1-token decode",
    }
    markdown = render_markdown(payload)
    json_path, md_path = write_results(Path(out_dir), f"decode_{device}", payload, markdown)
    print(markdown)
    print(f"\nwrote {json_path} and {md_path}")
    return 0


def render_markdown(payload: dict) -> str:
    md = ["# Plain decoding side by side, and verify cost, on one machine\n",
          provenance_markdown(payload["provenance"]),
          f"\n`--dtype auto` picks {payload['provenance']['settings']['auto_dtype']} on this machine.\n",
          "\n## Plain decode: ms per token after the prefill (N tokens each, interleaved prompt by prompt)\n",
          "| runtime | min | median | max | ratio to hspec float32 (median) | tokens/s (median) |",
          "|---|---|---|---|---|---|"]
    ratios = payload["plain_decode_ratio_to_float32"]
    for name, s in payload["plain_decode_ms_per_token"].items():
        ratio = f"{ratios[name]['median']:.2f}" if name in ratios else "1.00"
        md.append(f"| {_label(name)} | {s['min']:.1f} | {s['median']:.1f} | {s['max']:.1f} | {ratio} | "
                  f"{1000 / s['median']:.1f} |")
    if VLLM in payload["plain_decode_ms_per_token"]:
        md.append("\nvLLM's time after the prefill is a generate of N tokens minus a generate of 1 token on the same "
                  "prompt (its engine has no clock in between); its prefill time is the generate of 1 token.")
    md += ["\n## Verify of K+1 tokens over a 1-token decode (same context, interleaved)\n",
           "| dtype | K | tokens | min | median | max |", "|---|---|---|---|---|---|"]
    for name, per_k in payload["verify_over_decode"].items():
        for k, s in per_k.items():
            md.append(f"| {name} | {k} | {int(k) + 1} | {s['min']:.2f} | {s['median']:.2f} | {s['max']:.2f} |")
    md += ["\n## Greedy choice of an 8-token forward vs 1-token decoding at the same positions\n",
           "| dtype | positions | argmax differs | rate | logits differ in any bit |", "|---|---|---|---|---|"]
    for name, f in payload["argmax_flips_8_token_vs_1_token"].items():
        md.append(f"| {name} | {f['positions']} | {f['differ']} | {f['differ'] / max(f['positions'], 1):.4f} | "
                  f"{f.get('logits_differ', '–')} |")
    prefill = payload.get("prefill_ms", {})
    lengths = list(next(iter(prefill.values()), {}))
    if lengths:
        md += ["\n## Prefill: ms for one prompt of P tokens (median of the interleaved rounds)\n",
               "| runtime | " + " | ".join(f"P = {n}" for n in lengths) + " | tokens/s at the longest |",
               "|---|" + "---|" * (len(lengths) + 1)]
        for name, per_n in prefill.items():
            longest = per_n[lengths[-1]]["median"]
            md.append(f"| {_label(name)} | " + " | ".join(f"{per_n[n]['median']:.1f}" for n in lengths)
                      + f" | {1000 * int(lengths[-1]) / longest:.0f} |")
    md.append(f"\nGoals: {payload['goals']}.")
    return "\n".join(md) + "\n"


def _label(name: str) -> str:
    if name == UNFUSED:
        return "hspec float32, q/k/v and gate/up as separate matmuls (before the fast path)"
    if name == UNPACKED:
        return "hspec bfloat16, F.linear on plain weights (before prepacking)"
    if name.endswith(PYTHON_LAYERS):
        return f"hspec {name.removesuffix(PYTHON_LAYERS)}, decoder layers in Python (before the native stack)"
    if name.endswith(TORCH_KERNELS):
        return f"hspec {name.removesuffix(TORCH_KERNELS)} on torch's kernels (before hspec's CPU kernels)"
    if name == TRANSFORMERS:
        return "transformers generate, float32"
    if name == LLAMA_CPP:
        return "llama.cpp (llama-cpp-python), the GGUF's own Q4_1"
    if name == VLLM:
        return "vLLM (CPU build), bfloat16"
    if name == "int8":
        return "hspec int8 (int8 weight-only linears, bf16 activations)"
    if name == "int4":
        return "hspec int4 (int4 weight-only decoder layers in groups of 32, int8 LM head, bf16 activations)"
    if name == "w4a8":
        return ("hspec w4a8 (int4's weights; each product's input rows rounded to int8 blocks of 32, integer dot "
                "products)")
    return f"hspec {name}"


def unfused_copy(model: TargetModel) -> TargetModel:
    """A copy of `model` whose projections run as separate matmuls (the runtime before stacking)."""
    copied = copy.deepcopy(model)
    for module in copied.modules():
        if isinstance(module, QKVProjection):
            module.qkv_weight = module.qkv_bias = None
        elif isinstance(module, SwiGLU):
            module.gate_up_weight = None
    return copied


@dataclass(frozen=True)
class Runner:
    """One runtime of the side-by-side table. decode(ids): seconds of greedy decoding after the prefill
    of `ids`; prefill(ids): seconds of the one forward over `ids` that yields the first token."""

    decode: Callable[[list[int]], float]
    prefill: Callable[[list[int]], float]


def _hspec_runner(model: TargetModel, max_new_tokens: int) -> Runner:
    """Greedy plain decoding of `max_new_tokens` (the `--drafter none` path), and its prefill."""
    plain = SpeculativeDecoder(model, create_drafter("none", model.config), 1, eos_token_ids=())

    def decode(ids: list[int]) -> float:
        return plain.generate([ids], SamplingParams(), max_new_tokens).decode_s

    def prefill(ids: list[int]) -> float:
        pool = model.new_pool(num_pages=pages_for(len(ids), 16))
        pool.add_sequence(0)
        start = time.perf_counter()
        model.prefill(torch.tensor([ids]), pool, [0], last_logits_only=True)  # as generate prefills
        return time.perf_counter() - start
    return Runner(decode, prefill)


def _transformers_runner(target: Target, max_new_tokens: int) -> Runner:
    """The same for transformers' model and KV cache."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target.path), dtype=torch.float32).eval()

    def decode(ids: list[int]) -> float:
        out = hf(torch.tensor([ids]), use_cache=True)
        token = out.logits[:, -1:].argmax(-1)  # (1, 1)
        start = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            out = hf(token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - start

    def prefill(ids: list[int]) -> float:
        start = time.perf_counter()
        hf(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start
    return Runner(decode, prefill)


def _llama_cpp_runner(target_name: str, max_new_tokens: int, threads: int) -> Runner | None:
    """Greedy decoding in llama.cpp on the embedded target's GGUF: its own binaries when built
    (`_llama_cpp_server_runner`), else llama-cpp-python; None when neither is there, the target is not the
    embedded default (only it comes with a GGUF here), or llama-cpp-python's build crashes on this CPU
    (`llama_cpp_crash`, which then says so)."""
    if target_name not in (None, "smollm2"):
        return None
    from hspec.integrations.llama_cpp.binaries import find_bin_dir

    bin_dir = find_bin_dir()
    if bin_dir is not None:
        return _llama_cpp_server_runner(bin_dir, max_new_tokens, threads)
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    crash = llama_cpp_crash(default_gguf_path(), threads)
    if crash is not None:
        warnings.warn(crash, RuntimeWarning, stacklevel=2)
        return None
    llm = Llama(str(default_gguf_path()), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                logits_all=False, verbose=False)

    def decode(ids: list[int]) -> float:
        tokens = llm.generate(ids, temp=0.0, top_k=1, reset=True)
        next(tokens)  # the prefill's token
        start = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            next(tokens)
        elapsed = time.perf_counter() - start
        tokens.close()
        return elapsed

    def prefill(ids: list[int]) -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - start
    return Runner(decode, prefill)


def _llama_cpp_server_runner(bin_dir: Path, max_new_tokens: int, threads: int) -> Runner:
    """llama.cpp's own `llama-server` (one slot, no prompt cache) on the embedded GGUF; times are llama.cpp's
    own: `predicted_ms` spans the max_new_tokens - 1 tokens after the prefill's, `prompt_ms` the prefill.
    The server stops when this process exits."""
    import atexit

    from hspec.integrations.llama_cpp.binaries import LlamaServer

    server = LlamaServer(bin_dir, default_gguf_path(), threads=threads).__enter__()
    atexit.register(server.__exit__, None, None, None)

    def decode(ids: list[int]) -> float:
        return server.complete(ids, max_new_tokens).predicted_ms / 1000

    def prefill(ids: list[int]) -> float:
        return server.complete(ids, 1).prompt_ms / 1000
    return Runner(decode, prefill)


# Evaluates a 2-token batch in a process of its own: ggml's AMX matrix product segfaults on some AMX CPUs
# (ggml-org/llama.cpp issue 20824; on host fc-v1045 every batch of 2 or more tokens), which in this process
# would end the whole benchmark.
_LLAMA_CPP_PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=64, n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), verbose=False)
llm.eval(llm.tokenize(b"Hello there"))
"""
# How llama-cpp-python builds without ggml's AMX backend (docs/fast-path.md#an-amx-host).
LLAMA_CPP_WITHOUT_AMX = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
                         '-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON '
                         '-DGGML_AVX512_BF16=ON" pip install --force-reinstall --no-deps --no-cache-dir '
                         'llama-cpp-python')


def llama_cpp_crash(gguf: Path, threads: int) -> str | None:
    """None when the installed llama.cpp evaluates a 2-token batch of `gguf` in a child process, else what
    to tell the user: how it failed and how to build it without ggml's AMX backend."""
    probe = subprocess.run([sys.executable, "-c", _LLAMA_CPP_PROBE, str(gguf), str(threads)],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode == 0:
        return None
    how = f"signal {-probe.returncode}" if probe.returncode < 0 else f"exit status {probe.returncode}"
    return (f"llama.cpp (llama-cpp-python) failed evaluating a 2-token batch on this CPU ({how}); its column "
            f"is left out. On AMX CPUs ggml's AMX backend is known to crash; build it without: "
            f"{LLAMA_CPP_WITHOUT_AMX}")


def _vllm_runner(target: Target, max_new_tokens: int, longest_prompt: int, threads: int) -> Runner | None:
    """vLLM's CPU build on the target's HF folder (module doc), or None when vLLM is not installed."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return None
    from hspec.integrations.vllm import engine as vllm_engine

    vllm_engine.apply_environment(vllm_engine.cpu_environment(threads))
    llm = vllm_engine.open_llm(target.path, vllm_engine.VllmDrafter("none", None), "bfloat16",
                               max_model_len=max(1024, longest_prompt + max_new_tokens + 16))

    def prefill(ids: list[int]) -> float:
        return vllm_engine.generate_greedy(llm, ids, 1).seconds

    def decode(ids: list[int]) -> float:
        run = vllm_engine.generate_greedy(llm, ids, max_new_tokens)
        if len(run.token_ids) != max_new_tokens:
            raise RuntimeError(f"vLLM stopped after {len(run.token_ids)} of {max_new_tokens} tokens")
        return run.seconds - prefill(ids)
    return Runner(decode, prefill)


def prefill_prompt(target: Target, num_tokens: int, data_dir: str | None) -> list[int]:
    """`num_tokens` prompt tokens: the Spec-Bench prompts' tokens run together, cut to length."""
    ids: list[int] = []
    for item in load_task("spec_bench", data_dir=data_dir).items:
        if len(ids) >= num_tokens:
            break
        ids += target.tokenizer.encode_prompt(item.turns[0])
    if len(ids) < num_tokens:
        raise ValueError(f"--prefill-tokens {num_tokens} is more than the {len(ids)} tokens of every Spec-Bench prompt")
    return ids[:num_tokens]


def prefill_costs(runners: dict[str, Runner], prompt: list[int], lengths: Sequence[int], rounds: int
                  ) -> dict[str, dict[int, list[float]]]:
    """Milliseconds of each runner's prefill of `prompt[:n]` per n of `lengths`, interleaved runner by
    runner in each of `rounds` rounds after one untimed warm-up round."""
    ms: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in runners}
    for r in range(rounds + 1):
        for n in lengths:
            for name, runner in runners.items():
                elapsed = runner.prefill(prompt[:n])
                if r > 0:
                    ms[name][n].append(1000 * elapsed)
    return ms


def verify_costs(model: TargetModel, prompt: list[int], rounds: int) -> dict[int, list[float]]:
    """Per K: ratios time((K+1)-token forward) / time(1-token forward), both after the same prompt."""
    pool = prefilled_pool(model, prompt)
    vocab = model.config.vocab_size
    ratios: dict[int, list[float]] = {k: [] for k in VERIFY_KS}
    timed_forward(model, pool, torch.randint(0, vocab, (1, 1)))
    for _ in range(rounds):
        for k in VERIFY_KS:
            one = timed_forward(model, pool, torch.randint(0, vocab, (1, 1)))
            ratios[k].append(timed_forward(model, pool, torch.randint(0, vocab, (1, k + 1))) / one)
    return ratios


def argmax_flips(model: TargetModel, prompts: list[list[int]], num_tokens: int, block: int = 8) -> dict[str, int]:
    """`row_differences` of `block`-token forwards in consecutive blocks, summed over `prompts`."""
    total = {"positions": 0, "differ": 0, "logits_differ": 0}
    for prompt in prompts:
        for key, value in row_differences(model, prompt, num_tokens, (block,))[block].items():
            total[key] += value
    return total


def row_differences(model: TargetModel, prompt: list[int], num_tokens: int, widths: Sequence[int],
                    every_start: bool = False) -> dict[int, dict[str, int]]:
    """Decode `num_tokens` greedily one token at a time after `prompt`, then run the same tokens again in
    T-token forwards (as a verify would) for each T in `widths`: in consecutive blocks, or from every start
    position whose block the decode covers (`every_start`). Per T: positions compared, those whose argmax
    differs (`differ`) and whose logits differ from the decode's in any bit (`logits_differ`: a row-invariant
    runtime has none; a differing row is a tie waiting to flip)."""
    pool = model.new_pool(num_pages=pages_for(len(prompt) + num_tokens + max(widths), 16))
    pool.add_sequence(0)
    logits = model.prefill(torch.tensor([prompt]), pool, [0], last_logits_only=True).logits  # (1, 1, V)
    tokens, decoded = [int(logits[0, -1].argmax())], []
    for _ in range(num_tokens - 1):
        decoded.append(model(torch.tensor([tokens[-1:]]), pool, [0]).logits[0, -1])  # (V,)
        tokens.append(int(decoded[-1].argmax()))
    counts = {}
    for width in widths:
        c = counts[width] = {"positions": 0, "differ": 0, "logits_differ": 0}
        for start in range(num_tokens - width) if every_start else range(0, num_tokens - 1, width):
            pool.truncate(0, len(prompt) + start)
            rows = model(torch.tensor([tokens[start : start + width]]), pool, [0]).logits[0]  # (T, V)
            for row, expected in zip(rows, decoded[start : start + width]):
                c["positions"] += 1
                c["differ"] += int(row.argmax()) != int(expected.argmax())
                c["logits_differ"] += not torch.equal(row, expected)
    return counts


def prefilled_pool(model: TargetModel, prompt: list[int]):
    """A pool holding sequence 0 with `prompt` cached and room for 32 more positions."""
    pool = model.new_pool(num_pages=pages_for(len(prompt) + 32, 16))
    pool.add_sequence(0)
    model.prefill(torch.tensor([prompt]), pool, [0])
    return pool


def timed_forward(model: TargetModel, pool, ids: torch.Tensor) -> float:
    """Seconds of one forward of `ids` (1, n) after the cached prompt; the pool is cut back after it."""
    base = pool.length(0)
    t = time.perf_counter()
    model(ids, pool, [0])
    elapsed = time.perf_counter() - t
    pool.truncate(0, base)
    return elapsed


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}
