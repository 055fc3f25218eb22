"""`hspec bench serve`: closed-loop serving throughput and KV utilisation vs concurrency (paper Fig. 6).

1. Start one `hspec serve` subprocess per drafter kind on loopback (127.0.0.1, a free port), each
   with the same KV memory budget, so a kind that keeps drafter-side KV gets fewer tokens; with
   several `speculate_max_batch` values, one per drafting kind and value (labelled `KIND b<=N`).
2. For each concurrency level C, and for each kind in turn (the order alternates per level, so slow
   drift of the machine hits every kind alike): C clients each send a chat request, wait for it,
   and send the next (closed loop), over the same prompt sequence for every kind, until the level's
   time bound; then the in-flight requests finish.
   Throughput = output tokens / (last finish - start). Mean KV utilisation = the increase of the
   server's `hspec_kv_cache_usage_seconds_total` over that window / its length.
3. Write results/serving/serve_bench.{json,md}, throughput_vs_concurrency.png and
   kv_vs_concurrency.png, and the KV capacity in tokens at the budget for every registered kind
   (`PagedKVPool.from_memory_budget` with the kind's `num_drafter_layers`).

Greedy decoding throughout, and the first prompt's output must be identical on every server
(losslessness, end to end).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from hspec.cache.paged_pool import PagedKVPool
from hspec.data.tasks import load_suite
from hspec.drafters import DRAFTERS, PLAIN, create_drafter
from hspec.models.dtype import DTYPE_CHOICES
from hspec.models.loading import load_target
from hspec.provenance import provenance, provenance_markdown, write_results

MIB = 1 << 20


@dataclass(frozen=True)
class ServeBenchSettings:
    target: str = "smollm2"
    dtype: str = "auto"  # the target's dtype in every server (`hspec serve --dtype`; DTYPE_CHOICES)
    drafters: tuple[str, ...] = ("none", "ngram")  # kinds to serve; "none" = plain decoding
    concurrency: tuple[int, ...] = (8, 16, 32, 64, 128)  # closed-loop clients per level
    K: int = 7  # tokens drafted per step
    max_tokens: int = 64  # output tokens per request (greedy; EOS may end it sooner)
    level_seconds: float = 60.0  # clients stop sending new requests after this; in-flight ones finish
    tasks: tuple[str, ...] = ("spec_bench",)  # prompt sets (first user turn of each item)
    num_prompts: int = 240  # evenly spaced items per task
    max_prompt_tokens: int = 256  # longer prompts are skipped (the count is reported)
    kv_budget_mib: float = 256.0  # KV memory budget of every server (target + drafter layers)
    page_size: int = 16
    max_running: int = 128  # largest batch the engine runs
    speculate_max_batch: tuple[int | None, ...] = (None,)  # each drafting kind once per limit (None: always)
    name: str = "serve_bench"  # stem of the result files
    server_threads: int = 0  # torch threads per server (0 = torch's default)
    out: str = "results"  # results go to <out>/serving/
    drafter_paths: tuple[tuple[str, str], ...] = ()  # (kind, trained checkpoint dir) pairs
    random_drafter_weights: bool = False  # trained kinds without a checkpoint run untrained (timing / KV only)
    data_dir: str | None = None  # folder of the prompt sets (--data-dir); None: the data shipped in hspec/data

    def __post_init__(self) -> None:
        if not self.drafters:
            raise ValueError("give at least one drafter kind (none = plain decoding)")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        for kind in self.drafters:
            DRAFTERS.get(kind)  # raises ValueError listing the registered kinds
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        for name in ("K", "max_tokens", "num_prompts", "max_prompt_tokens", "page_size", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        unknown = sorted({kind for kind, _ in self.drafter_paths} - set(self.drafters))
        if unknown:
            raise ValueError(f"--drafter-path given for kinds not in --drafters: {unknown}")
        limits = self.speculate_max_batch
        if not limits or any(n is not None and n < 0 for n in limits) or len(set(limits)) < len(limits):
            raise ValueError(f"speculate_max_batch must be distinct integers >= 0 or None (always), got {limits}")
        if not self.name or "/" in self.name:
            raise ValueError(f"name must be a file stem without '/', got {self.name!r}")
        if self.level_seconds <= 0 or self.kv_budget_mib <= 0:
            raise ValueError(f"level_seconds and kv_budget_mib must be > 0, got {self.level_seconds}, "
                             f"{self.kv_budget_mib}")


def run_serve_bench(settings: ServeBenchSettings, command: str) -> int:
    target = load_target(settings.target, dtype=settings.dtype)  # as each server loads it: same KV bytes
    capacity = kv_capacity_table(target, settings.kv_budget_mib * MIB, settings.page_size)
    prompts, skipped = _prompts(target.tokenizer, settings)
    print(f"[bench serve] {len(prompts)} prompts ({skipped} longer than {settings.max_prompt_tokens} tokens "
          f"skipped); kinds {', '.join(settings.drafters)}; concurrency {settings.concurrency}", flush=True)
    model_name, runtime_dtype = target.name, target.model.dtype_name
    del target  # the servers load their own copies

    logs = Path(tempfile.mkdtemp(prefix="hspec-bench-serve-"))
    configs = server_configs(settings)
    servers = {label: ServerProcess(label, kind, limit, settings, logs / f"server{i}.log")
               for i, (label, kind, limit) in enumerate(configs)}
    levels: dict[str, list[dict[str, Any]]] = {label: [] for label in servers}
    try:
        for server in servers.values():
            server.wait_ready()
        _check_lossless(servers, model_name, prompts[0], settings.max_tokens)
        for i, c in enumerate(settings.concurrency):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for label in order:
                result = asyncio.run(run_level(servers[label].url, model_name, prompts, c, settings))
                levels[label].append(result)
                print(f"[bench serve] {label:>8} C={c:<4} {result['throughput_tok_s']:8.1f} tok/s  "
                      f"KV {100 * result['mean_kv_utilization']:5.1f}%  MAL {result['mean_accepted_length']:.2f}  "
                      f"{result['num_requests']} requests, {result['preemptions']} preemptions", flush=True)
    finally:
        for server in servers.values():
            server.stop()

    payload = {
        "provenance": provenance(command, {**asdict(settings), "prompts": len(prompts),
                                           "prompts_skipped": skipped, "model": model_name,
                                           "runtime_dtype": runtime_dtype}),
        "levels": levels,
        "servers": {label: s.info for label, s in servers.items()},
        "drafter_weights": {kind: _weights(kind, settings) for kind in settings.drafters},
        "kv_capacity": capacity,
    }
    out = Path(settings.out) / "serving"
    markdown = _markdown(payload, settings)
    json_path, md_path = write_results(out, settings.name, payload, markdown)
    plots = _plots(levels, out, "" if settings.name == "serve_bench" else f"{settings.name}_")
    print(markdown)
    print(f"wrote {json_path}, {md_path}, " + ", ".join(str(p) for p in plots))
    return 0


def server_configs(settings: ServeBenchSettings) -> list[tuple[str, str, int | None]]:
    """(label, kind, speculate_max_batch) of every server: plain decoding once, each drafting kind once per
    limit, labelled KIND when it always speculates and `KIND b<=N` otherwise."""
    configs = []
    for kind in settings.drafters:
        limits = settings.speculate_max_batch if DRAFTERS.get(kind).drafts else (None,)
        configs += [(kind if n is None else f"{kind} b<={n}", kind, n) for n in limits]
    return configs


def kv_capacity_table(target, budget_bytes: float, page_size: int) -> list[dict[str, Any]]:
    """KV capacity in tokens at `budget_bytes` for every registered kind (pool built on `meta`: no memory)."""
    c = target.config
    dtype = target.model.kv_dtype
    rows = []
    for kind in DRAFTERS.names():
        try:
            layers = create_drafter(kind, c, target_model=target.model).num_drafter_layers
        except (ValueError, TypeError) as err:
            rows.append({"drafter": kind, "error": str(err)})
            continue
        pool = PagedKVPool.from_memory_budget(int(budget_bytes), c.num_layers, c.num_kv_heads, c.head_dim,
                                              page_size, layers, dtype, device="meta")
        rows.append({"drafter": kind, "drafter_kv_layers": layers, "capacity_tokens": pool.capacity_tokens,
                     "kv_bytes_per_token": PagedKVPool.bytes_per_token(c.num_layers + layers, c.num_kv_heads,
                                                                       c.head_dim, dtype),
                     "kv_inflation": (c.num_layers + layers) / c.num_layers})
    return rows


def _weights(kind: str, settings: ServeBenchSettings) -> str:
    path = dict(settings.drafter_paths).get(kind)
    if path:
        return f"trained: {path}"
    if not DRAFTERS.get(kind).needs_target_model:
        return "model-free"
    return "random (untrained)" if settings.random_drafter_weights else "shipped checkpoint for the target"


# ---- servers and clients ------------------------------------------------------------------------


class ServerProcess:
    """An `hspec serve` subprocess on 127.0.0.1 and a free port."""

    def __init__(self, label: str, kind: str, speculate_max_batch: int | None, settings: ServeBenchSettings,
                 log_path: Path) -> None:
        self.label = label
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        args = [sys.executable, "-m", "hspec.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--target", settings.target, "--dtype", settings.dtype, "--drafter", kind, "--k", str(settings.K),
                "--kv-budget-mib", str(settings.kv_budget_mib), "--page-size", str(settings.page_size),
                "--max-running", str(settings.max_running), "--threads", str(settings.server_threads),
                "--log-level", "warning"]
        if speculate_max_batch is not None:
            args += ["--spec-max-batch", str(speculate_max_batch)]
        path = dict(settings.drafter_paths).get(kind)
        if path:
            args += ["--drafter-path", path]
        elif settings.random_drafter_weights:
            args.append("--random-drafter-weights")
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        self.info: dict[str, Any] = {}

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server for {self.label} exited with {self.process.returncode}:\n{self._tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.info = httpx.get(f"{self.url}/v1/models", timeout=5).json()["data"][0]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server for {self.label} not ready after {timeout_s:.0f} s:\n{self._tail()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()

    def _tail(self) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])


def scrape_metrics(url: str) -> dict[str, float]:
    """The numeric samples of a server's /metrics, by name with labels (names may hold colons, as vLLM's do)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([\w:]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """An OpenAI chat request: one user turn, greedy."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}


def _check_lossless(servers: dict[str, ServerProcess], model: str, prompt: str, max_tokens: int) -> None:
    """Warm every server up with the same greedy request; outputs must be identical."""
    texts = {kind: httpx.post(f"{s.url}/v1/chat/completions", json=request_body(model, prompt, max_tokens), timeout=600)
             .json()["choices"][0]["message"]["content"] for kind, s in servers.items()}
    if len(set(texts.values())) != 1:
        raise RuntimeError(f"greedy outputs differ between servers (lossless bug): {texts}")


async def run_level(url: str, model: str, prompts: Sequence[str], concurrency: int,
                     settings: ServeBenchSettings) -> dict[str, Any]:
    """C closed-loop clients until the time bound; every kind sees the same prompt sequence."""
    before = scrape_metrics(url)
    next_prompt = itertools.count()
    tokens: list[int] = []
    latencies: list[float] = []
    start = time.perf_counter()
    stop_at = start + settings.level_seconds
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def scrape_at_stop() -> tuple[float, dict[str, float]]:
        """/metrics when the clients stop sending: the window in which all C were busy ends here."""
        await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
        now = time.perf_counter()
        return now, await asyncio.to_thread(scrape_metrics, url)

    async def client(http: httpx.AsyncClient) -> None:
        while time.perf_counter() < stop_at:
            prompt = prompts[next(next_prompt) % len(prompts)]
            t0 = time.perf_counter()
            response = await http.post(f"{url}/v1/chat/completions",
                                       json=request_body(model, prompt, settings.max_tokens))
            response.raise_for_status()
            tokens.append(response.json()["usage"]["completion_tokens"])
            latencies.append(time.perf_counter() - t0)

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as http:
        scrape = asyncio.create_task(scrape_at_stop())
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        window_end, at_stop = await scrape
    elapsed = time.perf_counter() - start
    window = window_end - start
    after = scrape_metrics(url)

    def delta(name: str, end: dict[str, float] = after) -> float:
        return end.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("hspec_spec_decode_steps_total")
    accepted = [delta(f'hspec_spec_decode_accepted_tokens_total{{position="{k}"}}') for k in range(1, settings.K + 1)]
    return {
        "concurrency": concurrency,
        # Over the window [start, stop]: all C clients busy (ramp-up included, drain excluded).
        "window_s": window,
        "throughput_tok_s": delta("hspec_generation_tokens_total", at_stop) / window,
        "mean_kv_utilization": delta("hspec_kv_cache_usage_seconds_total", at_stop) / window,
        # Over the whole level, drain included: completed requests.
        "num_requests": len(tokens),
        "output_tokens": sum(tokens),
        "elapsed_s": elapsed,
        "throughput_completed_tok_s": sum(tokens) / elapsed,
        "mean_latency_s": sum(latencies) / len(latencies),
        "load_avg_1m": os.getloadavg()[0],
        "mean_accepted_length": 1.0 + sum(accepted) / steps if steps else 1.0,
        "preemptions": int(delta("hspec_preemptions_total")),
        "engine_steps": int(delta("hspec_engine_steps_total")),
        "mean_batch": delta("hspec_decode_rows_total") / max(delta("hspec_engine_steps_total"), 1.0),
    }


def _prompts(tokenizer, settings: ServeBenchSettings) -> tuple[list[str], int]:
    """First user turns of the tasks' items, interleaved across tasks, without over-long ones."""
    tasks = load_suite(settings.tasks, settings.num_prompts, settings.data_dir)
    turns = [item.turns[0] for group in itertools.zip_longest(*(t.items for t in tasks)) for item in group if item]
    kept = [t for t in turns if len(tokenizer.encode_prompt(t)) <= settings.max_prompt_tokens]
    if not kept:
        raise ValueError(f"no prompt of {settings.tasks} fits in max_prompt_tokens={settings.max_prompt_tokens}")
    return kept, len(turns) - len(kept)


# ---- report -------------------------------------------------------------------------------------


def _markdown(payload: dict[str, Any], settings: ServeBenchSettings) -> str:
    levels = payload["levels"]
    md = ["# Serving: closed-loop throughput and KV utilisation vs concurrency\n",
          provenance_markdown(payload["provenance"]),
          f"\nEach level: C closed-loop clients send greedy chat requests of at most {settings.max_tokens} tokens "
          f"for {settings.level_seconds:.0f} s, then the in-flight ones finish; KV budget "
          f"{settings.kv_budget_mib:g} MiB per server; kinds interleaved per level. Output tok/s and mean KV "
          "utilisation are over the window in which all C clients were busy (server counters); completed tok/s "
          "counts finished requests over the whole level, drain included. MAL and mean batch are over the level.\n",
          "| server | C | output tok/s | vs plain | mean KV util. | MAL | mean batch | completed tok/s | requests | "
          "mean latency (s) | preemptions | load avg |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = {r["concurrency"]: r["throughput_tok_s"] for r in levels.get(PLAIN, [])}
    for kind, rows in levels.items():
        for r in rows:
            ratio = f"{r['throughput_tok_s'] / plain[r['concurrency']]:.2f}x" if r["concurrency"] in plain else "-"
            md.append(f"| {kind} | {r['concurrency']} | {r['throughput_tok_s']:.1f} | {ratio} | "
                      f"{100 * r['mean_kv_utilization']:.1f}% | {r['mean_accepted_length']:.2f} | "
                      f"{r['mean_batch']:.1f} | {r['throughput_completed_tok_s']:.1f} | {r['num_requests']} | "
                      f"{r['mean_latency_s']:.1f} | {r['preemptions']} | {r['load_avg_1m']:.1f} |")
    md += [f"\n## KV capacity at a {settings.kv_budget_mib:g} MiB budget (page size {settings.page_size})\n",
           "| drafter | drafter KV layers | KV bytes/token | capacity (tokens) | KV inflation |",
           "|---|---|---|---|---|"]
    for row in payload["kv_capacity"]:
        if "error" in row:
            md.append(f"| {row['drafter']} | - | - | - | not built: {row['error']} |")
        else:
            md.append(f"| {row['drafter']} | {row['drafter_kv_layers']} | {row['kv_bytes_per_token']} | "
                      f"{row['capacity_tokens']} | {row['kv_inflation']:.3f} |")
    return "\n".join(md) + "\n"


def _plots(levels: dict[str, list[dict[str, Any]]], out: Path, prefix: str = "") -> list[Path]:
    """Throughput and mean KV utilisation vs concurrency, one line per kind (paper Fig. 6)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    paths = []
    for key, label, scale, stem in (("throughput_tok_s", "output tokens / s", 1.0, "throughput_vs_concurrency"),
                                    ("mean_kv_utilization", "mean KV utilisation (%)", 100.0, "kv_vs_concurrency")):
        fig = Figure(figsize=(5.5, 3.8), tight_layout=True)
        ax = fig.add_subplot()
        for kind, rows in levels.items():
            ax.plot([r["concurrency"] for r in rows], [scale * r[key] for r in rows], marker="o",
                    label="plain" if kind == PLAIN else kind)
        ax.set_xscale("log", base=2)
        levels_c = sorted({r["concurrency"] for rows in levels.values() for r in rows})
        ax.set_xticks(levels_c, [str(c) for c in levels_c])
        ax.set_xlabel("concurrency (closed-loop clients)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = out / f"{prefix}{stem}.png"
        FigureCanvasAgg(fig).print_png(str(path))
        paths.append(path)
    return paths
