"""`hspec bench vllm-serve`: serving throughput vs concurrency through vLLM's OpenAI server (paper Fig. 6),
with hspec's own server on the same prompts for comparison.

1. For each vLLM configuration (`--drafters`, as `hspec bench vllm` takes them; plain always runs), start
   `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 (a free port, eager, the target's HF
   folder, the configuration's speculative config; H-Spec through hspec's plugin and proposer), one
   server at a time. On the plain server, first send the N prompts one at a time: the batch-1 reference.
2. At each concurrency C, send the same N chat requests (greedy, streamed) with at most C in flight, and
   measure output tokens/s (output tokens / wall time from the first send to the last finish), request
   latency and time to first token (p50/p90, client side), KV-cache use (the server's usage gauge,
   sampled every `kv_sample_s` while the level runs: mean and peak), tau (the server's spec-decode
   counters over the level) and how many outputs equal the batch-1 reference text.
3. The same for `hspec serve` with the matching drafter (`none`, `ngram` with the same K, the DFlash
   checkpoint an export came from, the same H-Spec checkpoint with the same K), with the same KV budget
   and the same OpenMP thread count.
4. Write <out>/serve_<dtype>.{json,md} with provenance and serve_<dtype>_throughput.png.

Subprocess servers make this `if __name__ == "__main__":`-safe: no vLLM engine lives in this process.
Server lifecycle, request body and /metrics parsing are `hspec.bench.serve`'s.
Legend: N requests per level, C concurrency, K drafts per step.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hspec.bench.serve import ServerProcess, free_port, request_body, scrape_metrics
from hspec.bench.vllm import HSPEC_ENGINE, hspec_counterpart, materialize_random, read_prompts, vllm_version
from hspec.drafters import PLAIN
from hspec.integrations.vllm import engine as vllm_engine
from hspec.provenance import provenance, provenance_markdown, write_results

REFERENCE_CONCURRENCY = 1  # the batch-1 plain run every output is compared with


@dataclass(frozen=True)
class ServeMetricNames:
    """Where one server kind publishes what the bench reads from /metrics (summed over label sets)."""

    kv_usage: str  # gauge, fraction of KV blocks in use (0..1)
    drafts: str  # counter: verify steps that carried drafts
    accepted: str  # counter: accepted draft tokens (hspec: per position, summed)


VLLM_METRICS = ServeMetricNames("vllm:kv_cache_usage_perc", "vllm:spec_decode_num_drafts_total",
                                "vllm:spec_decode_num_accepted_tokens_total")
HSPEC_METRICS = ServeMetricNames("hspec_kv_cache_usage_fraction", "hspec_spec_decode_steps_total",
                                 "hspec_spec_decode_accepted_tokens_total")


@dataclass(frozen=True)
class VllmServeSettings:
    target: str = "smollm2"
    drafters: str = "none,ngram,hspec"  # vLLM configurations, `hspec bench vllm`'s syntax
    concurrency: tuple[int, ...] = (8, 16, 32, 64)  # requests in flight at most, per level
    num_requests: int = 64  # N: prompts 0..N-1 sent once per level
    max_tokens: int = 64  # output tokens per request (greedy; EOS may end it sooner)
    dtype: str = "float32"  # vLLM's compute dtype and hspec server's --dtype
    K: int = 5  # drafts per step for ngram (DFlash: its export's; H-Spec: its checkpoint's block size)
    max_model_len: int = 2048  # the longest evenly spaced Spec-Bench prompts need more than 1,024
    kv_cache_gib: int = 1  # vLLM's KV cache; hspec's server gets the same budget
    threads: int = 2  # OpenMP / torch threads of every server (the servers run one at a time)
    kv_sample_s: float = 0.5  # /metrics polling period for the KV-usage gauge
    prompts_file: str | None = None  # {"prompt": ...} per line; None: N evenly spaced Spec-Bench items
    hspec_engine: bool = True  # also run `hspec serve` with the matching drafters
    out: str = "results/vllm"
    name: str | None = None  # file stem; None: serve_<dtype>
    data_dir: str | None = None
    server_timeout_s: float = 900.0  # a server not ready by then is an error

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        for name in ("num_requests", "max_tokens", "K", "max_model_len", "kv_cache_gib", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.kv_sample_s <= 0:
            raise ValueError(f"kv_sample_s must be > 0, got {self.kv_sample_s}")


@dataclass(frozen=True)
class RequestResult:
    """One streamed chat request."""

    index: int  # prompt index
    text: str
    completion_tokens: int  # the server's usage count
    latency_s: float  # send to last byte
    ttft_s: float | None  # send to first content chunk; None when no content came


@dataclass
class LevelResult:
    """One concurrency level against one server."""

    concurrency: int
    requests: list[RequestResult]
    elapsed_s: float  # first send to last finish
    kv_samples: list[float] = field(default_factory=list)  # usage fractions sampled while it ran
    metrics_before: dict[str, float] = field(default_factory=dict)
    metrics_after: dict[str, float] = field(default_factory=dict)


# ---- servers ------------------------------------------------------------------------------------


class _Subprocess(ServerProcess):
    """A server subprocess from `make_args(port)`, on 127.0.0.1; readiness and shutdown are `ServerProcess`'s
    (`/health`, then `/v1/models`; terminate, kill after 30 s)."""

    def __init__(self, kind: str, make_args: Callable[[int], list[str]], log_path: Path,
                 env: dict[str, str]) -> None:  # not `ServerProcess.__init__`: that builds `hspec serve`'s command line
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        # A session of its own: vLLM's server starts an engine process, which `stop` ends with it.
        self.process = subprocess.Popen(make_args(self.port), stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **env}, start_new_session=True)
        self.info: dict[str, Any] = {}

    def stop(self) -> None:
        """SIGTERM to the server's process group (its engine processes too), SIGKILL after 30 s."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self._log.close()


def vllm_server_args(model_dir: Path, drafter: vllm_engine.VllmDrafter, settings: VllmServeSettings,
                     served_name: str, port: int) -> list[str]:
    """Command line of vLLM's OpenAI server for one configuration (eager, greedy-ready, seed 0)."""
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", settings.dtype, "--enforce-eager", "--max-model-len", str(settings.max_model_len),
            "--max-num-seqs", str(max(settings.concurrency)), "--seed", "0", "--disable-uvicorn-access-log"]
    if drafter.speculative_config is not None:
        args += ["--speculative-config", json.dumps(drafter.speculative_config)]
    if drafter.hf_overrides:
        args += ["--hf-overrides", json.dumps(drafter.hf_overrides)]
    return args


def hspec_server_args(target: str, kind: str, path: Path | None, K: int, settings: VllmServeSettings,
                      served_name: str, port: int) -> list[str]:
    """Command line of `hspec serve` with drafter `kind` (checkpoint `path`), K drafts, the same KV budget."""
    args = [sys.executable, "-m", "hspec.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--target", target, "--served-model-name", served_name, "--drafter", kind, "--k", str(max(K, 1)),
            "--dtype", settings.dtype, "--kv-budget-mib", str(1024 * settings.kv_cache_gib),
            "--max-running", str(max(settings.concurrency)), "--threads", str(settings.threads),
            "--log-level", "warning"]
    return args + (["--drafter-path", str(path)] if path is not None else [])


def kv_capacity_tokens(metrics_text: str) -> int | None:
    """The server's KV capacity in tokens from its /metrics text: vLLM's `vllm:cache_config_info` labels
    (num_gpu_blocks x block_size) or hspec's `hspec_kv_cache_capacity_tokens`; None when neither is there."""
    for line in metrics_text.splitlines():
        if line.startswith("hspec_kv_cache_capacity_tokens "):
            return int(float(line.split()[1]))
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels.get("num_gpu_blocks", "").isdigit() and labels.get("block_size", "").isdigit():
                return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    return None


def metric_total(samples: dict[str, float], name: str) -> float:
    """Sum of `name` over all its label sets (vLLM labels every sample by engine and model)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


# ---- clients ------------------------------------------------------------------------------------


async def stream_chat(http: httpx.AsyncClient, url: str, model: str, index: int, prompt: str,
                      max_tokens: int) -> RequestResult:
    """One greedy chat request, streamed (SSE) so the first content chunk gives TTFT."""
    body = {**request_body(model, prompt, max_tokens), "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, parts, tokens = None, [], 0
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{url}: request {index} got HTTP {response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    ttft = time.perf_counter() - start if ttft is None else ttft
                    parts.append(text)
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    return RequestResult(index, "".join(parts), tokens, time.perf_counter() - start, ttft)


async def run_level(url: str, model: str, prompts: Sequence[str], concurrency: int, max_tokens: int,
                    kv_metric: str, kv_sample_s: float) -> LevelResult:
    """Every prompt once, at most `concurrency` in flight (each client takes the next prompt when its
    request finishes); the KV-usage gauge `kv_metric` is sampled every `kv_sample_s` meanwhile."""
    before = await asyncio.to_thread(scrape_metrics, url)
    queue = iter(range(len(prompts)))
    results: list[RequestResult] = []
    samples: list[float] = []
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def client(http: httpx.AsyncClient) -> None:
        for index in queue:
            results.append(await stream_chat(http, url, model, index, prompts[index], max_tokens))

    async def sample_kv() -> None:
        while not done.is_set():
            samples.append(metric_total(await asyncio.to_thread(scrape_metrics, url), kv_metric))
            try:
                await asyncio.wait_for(done.wait(), kv_sample_s)
            except asyncio.TimeoutError:
                pass

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as http:
        sampler = asyncio.create_task(sample_kv())
        start = time.perf_counter()
        try:
            await asyncio.gather(*(client(http) for _ in range(min(concurrency, len(prompts)))))
        finally:
            elapsed = time.perf_counter() - start
            done.set()
            await sampler
    after = await asyncio.to_thread(scrape_metrics, url)
    return LevelResult(concurrency, sorted(results, key=lambda r: r.index), elapsed, samples, before, after)


# ---- summaries ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between order statistics; None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize_level(drafter: str, engine: str, level: LevelResult, names: ServeMetricNames,
                    reference: Sequence[str] | None, kv_capacity: int | None) -> dict[str, Any]:
    """One result row: throughput, latency and TTFT percentiles, KV use, tau, equality with the reference."""
    reqs = level.requests
    tokens = sum(r.completion_tokens for r in reqs)
    ttfts = [r.ttft_s for r in reqs if r.ttft_s is not None]
    drafts = metric_total(level.metrics_after, names.drafts) - metric_total(level.metrics_before, names.drafts)
    accepted = metric_total(level.metrics_after, names.accepted) - metric_total(level.metrics_before, names.accepted)
    return {
        "drafter": drafter,
        "engine": engine,
        "concurrency": level.concurrency,
        "num_requests": len(reqs),
        "output_tokens": tokens,
        "elapsed_s": level.elapsed_s,
        "output_tok_s": tokens / max(level.elapsed_s, 1e-9),
        "requests_per_s": len(reqs) / max(level.elapsed_s, 1e-9),
        "latency_p50_s": percentile([r.latency_s for r in reqs], 50),
        "latency_p90_s": percentile([r.latency_s for r in reqs], 90),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "kv_usage_mean": sum(level.kv_samples) / len(level.kv_samples) if level.kv_samples else None,
        "kv_usage_peak": max(level.kv_samples, default=None),
        "kv_capacity_tokens": kv_capacity,
        "tau": 1.0 + accepted / drafts if drafts else None,
        "outputs_equal_plain_batch1": (None if reference is None else
                                       sum(r.text == reference[r.index] for r in reqs)),
        "load_avg_1m": os.getloadavg()[0],
    }


# ---- the bench ----------------------------------------------------------------------------------


def run_vllm_serve_bench(settings: VllmServeSettings, command: str) -> int:
    """`hspec bench vllm-serve` (module docstring); DFlash exports live in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="hspec-vllm-serve-") as root:
        return _run(settings, command, Path(root))


def _run(settings: VllmServeSettings, command: str, root: Path) -> int:
    from hspec.models.loading import load_target

    target = load_target(settings.target)
    configs = vllm_engine.parse_drafters(settings.drafters, settings.K)
    configs = [materialize_random(c, target, root) for c in configs]
    configs = [vllm_engine.resolve_export(c, root / "vllm", target.path) for c in configs]
    configs = [vllm_engine.resolve_hspec(c, target.name) for c in configs]
    prompts = read_prompts(settings.prompts_file, settings.num_requests, settings.data_dir)
    most_K = max([settings.K, *(c.K for c in configs if c.speculative_config)])
    lengths = [len(target.tokenizer.encode_prompt(p)) for p in prompts]
    too_long = [i for i, n in enumerate(lengths) if n + settings.max_tokens + most_K + 1 > settings.max_model_len]
    if too_long:
        raise ValueError(f"prompts {too_long} plus --max-tokens {settings.max_tokens} exceed --max-model-len "
                         f"{settings.max_model_len}; raise it or shorten them")
    served = target.name
    env = vllm_engine.cpu_environment(settings.threads, settings.kv_cache_gib)
    logs = root / "logs"
    logs.mkdir()
    print(f"[bench vllm-serve] {len(prompts)} requests per level, concurrency {settings.concurrency}, "
          f"configurations {', '.join(c.name for c in configs)}; server logs in {logs}", flush=True)

    plain = next(c for c in configs if c.speculative_config is None)
    ordered = [plain] + [c for c in configs if c is not plain]  # the reference comes from plain, first
    rows: list[dict[str, Any]] = []
    reference: list[str] = []
    for config in ordered:
        def make_args(port: int, config: vllm_engine.VllmDrafter = config) -> list[str]:
            return vllm_server_args(target.path, config, settings, served, port)

        rows += _serve_levels(config.name, "vllm", make_args, env, logs, VLLM_METRICS, settings, prompts,
                              served, reference, config is plain)
        if config is plain:
            reference = [r["_texts"] for r in rows if r["concurrency"] == REFERENCE_CONCURRENCY][0]
    if settings.hspec_engine:
        for config in ordered:
            counterpart = hspec_counterpart(config, target.name)
            if counterpart is None:
                continue
            kind, path = counterpart
            K = config.K if config.speculative_config else 0

            def make_args(port: int, kind: str = kind, path: Path | None = path, K: int = K) -> list[str]:
                return hspec_server_args(settings.target, kind, path, K, settings, served, port)

            rows += _serve_levels(config.name, HSPEC_ENGINE, make_args, env, logs, HSPEC_METRICS, settings, prompts,
                                  served, reference, False)
    for row in rows:
        row.pop("_texts")

    meta = provenance(command, {**asdict(settings), "concurrency": list(settings.concurrency), "model": served,
                                "num_prompts": len(prompts), "prompt_tokens_max": max(lengths),
                                "K_per_drafter": {c.name: c.K
                                                  for c in configs if c.speculative_config},
                                "enforce_eager": True, "vllm": vllm_version(), **env})
    out = Path(settings.out)
    stem = settings.name or f"serve_{settings.dtype}"
    markdown = render_markdown(meta, rows)
    json_path, md_path = write_results(out, stem, {"meta": meta, "rows": rows}, markdown)
    plot = plot_throughput(rows, out / f"{stem}_throughput.png")
    print(markdown)
    print(f"wrote {json_path}, {md_path}, {plot}")
    return 0


def _serve_levels(name: str, engine: str, make_args: Callable[[int], list[str]], env: dict[str, str], logs: Path,
                  names: ServeMetricNames, settings: VllmServeSettings, prompts: Sequence[str], served: str,
                  reference: Sequence[str], is_reference: bool) -> list[dict[str, Any]]:
    """Start one server, warm it up, run the reference level (plain vLLM only) and every concurrency level."""
    log = logs / f"{engine}-{name.replace('/', '_').replace('=', '-')}.log"
    server = _Subprocess(name, make_args, log, env)
    rows = []
    try:
        server.wait_ready(settings.server_timeout_s)
        capacity = kv_capacity_tokens(httpx.get(f"{server.url}/metrics", timeout=30).text)
        asyncio.run(run_level(server.url, served, prompts[:1], 1, 4, names.kv_usage, settings.kv_sample_s))  # warm-up
        levels = ((REFERENCE_CONCURRENCY,) if is_reference else ()) + tuple(
            c for c in settings.concurrency if not (is_reference and c == REFERENCE_CONCURRENCY))
        for c in levels:
            level = asyncio.run(run_level(server.url, served, prompts, c, settings.max_tokens, names.kv_usage,
                                          settings.kv_sample_s))
            texts = [r.text for r in level.requests]
            if is_reference and c == REFERENCE_CONCURRENCY:
                reference = texts  # the later levels of this server compare with it too
            row = summarize_level(name, engine, level, names, reference, capacity)
            rows.append({**row, "_texts": texts})
            print(f"[bench vllm-serve] {engine:>5} {name:>12} C={c:<3} {row['output_tok_s']:7.1f} tok/s  "
                  f"p50 {row['latency_p50_s']:.2f} s  KV peak {_pct(row['kv_usage_peak'])}  "
                  f"equal {row['outputs_equal_plain_batch1']}/{row['num_requests']}", flush=True)
    finally:
        server.stop()
    return rows


# ---- report -------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render_markdown(meta: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    lines = ["# hspec bench vllm-serve: serving throughput vs concurrency (vLLM OpenAI server and hspec serve)", "",
             provenance_markdown(meta),
             "| drafter | engine | C | output tok/s | vs plain | req/s | latency p50 / p90 (s) | TTFT p50 / p90 (s) "
             "| KV use mean / peak | KV capacity (tokens) | tau | outputs equal plain batch-1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = {(r["engine"], r["concurrency"]): r["output_tok_s"] for r in rows if r["drafter"] == PLAIN}
    for r in rows:
        base = plain.get((r["engine"], r["concurrency"]))
        ratio = f"{r['output_tok_s'] / base:.2f}x" if base else "-"
        kv = "" if r["kv_capacity_tokens"] is None else f"{r['kv_capacity_tokens']:,}"
        equal = r["outputs_equal_plain_batch1"]
        equal = "-" if equal is None else f"{equal}/{r['num_requests']}"
        lines.append(f"| {r['drafter']} | {r['engine']} | {r['concurrency']} | {r['output_tok_s']:.1f} | {ratio} | "
                     f"{r['requests_per_s']:.2f} | {_num(r['latency_p50_s'], '.2f')} / "
                     f"{_num(r['latency_p90_s'], '.2f')} | "
                     f"{_num(r['ttft_p50_s'], '.2f')} / {_num(r['ttft_p90_s'], '.2f')} | "
                     f"{_pct(r['kv_usage_mean'])} / {_pct(r['kv_usage_peak'])} | {kv} | {_num(r['tau'], '.2f')} | "
                     f"{equal} |")
    lines += ["", "Each level sends the same N greedy chat requests (streamed) with at most C in flight. output tok/s: "
              "output tokens / (last finish - first send). Latency and TTFT (first content chunk) are client-side. "
              "KV use: the server's usage gauge (`vllm:kv_cache_usage_perc`, `hspec_kv_cache_usage_fraction`) "
              "sampled while the level ran. tau: 1 + accepted / drafted steps from the server's counters over the "
              "level (vLLM counts only steps that carried drafts). The C = 1 row of vLLM plain is the batch-1 "
              "reference; `outputs equal` compares each output text with it (exact in float32; with bfloat16 "
              "batching changes the arithmetic, so the column is a divergence count)."]
    return "\n".join(lines) + "\n"


def plot_throughput(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Output tokens/s vs concurrency, one line per (drafter, engine)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 4.0), tight_layout=True)
    ax = fig.add_subplot()
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in rows:
        if r["concurrency"] != REFERENCE_CONCURRENCY or r["drafter"] != PLAIN or r["engine"] != "vllm":
            series.setdefault((r["drafter"], r["engine"]), []).append((r["concurrency"], r["output_tok_s"]))
    for (drafter, engine), points in series.items():
        points.sort()
        label = f"{'plain' if drafter == PLAIN else drafter} ({engine})"
        ax.plot([c for c, _ in points], [t for _, t in points], marker="o",
                linestyle="-" if engine == "vllm" else "--", label=label)
    levels = sorted({c for points in series.values() for c, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens / s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig).print_png(str(path))
    return path
