"""Prometheus metrics of one server instance (its own registry: no global state).

Names follow Prometheus conventions (counters end in `_total` in the exposition). Acceptance is
exported as counters so any window can be computed from two scrapes:

- `hspec_spec_decode_steps_total`: sequence-steps that verified at least one draft (one per drafting
  sequence per engine step; a `KIND:auto` row that drafts nothing runs a plain decode step, not counted);
- `hspec_spec_decode_accepted_tokens_total{position="k"}`: sequence-steps whose first k drafts were
  all accepted, k = 1..K; MAL tau = 1 + sum_k accepted[k] / steps (also exported as a gauge over the
  lifetime);
- `hspec_spec_decode_verified_tokens_total{position="k"}`: sequence-steps that accepted their first k-1
  drafts and verified a k-th; conditional acceptance at k is accepted[k] / verified[k]. It equals
  accepted[k-1] unless a `KIND:P` drafter stopped early: a step that verified n < K drafts and
  accepted them all was not refused a draft at n+1, so it is left out there;
- `hspec_kv_cache_usage_seconds_total`: the time integral of the KV usage fraction over wall-clock
  time, so the mean utilisation over a window is its increase divided by the window's length.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from hspec.serving.engine import StepReport

__all__ = ["CONTENT_TYPE_LATEST", "ServingMetrics"]


class ServingMetrics:
    """Counters and gauges of one server; the engine thread and HTTP handlers both update them."""

    def __init__(self, model_name: str, drafter_kind: str, K: int, kv_capacity_tokens: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.K = K
        info = Gauge("hspec_server_info", "Served model and drafter (value 1)", ["model", "drafter", "K"], registry=r)
        info.labels(model_name, drafter_kind, str(K)).set(1)
        Gauge("hspec_kv_cache_capacity_tokens", "Token capacity of the KV pool", registry=r).set(kv_capacity_tokens)
        self.http_requests = Counter("hspec_http_requests", "HTTP requests by path and status code",
                                     ["path", "status"], registry=r)
        self.requests_finished = Counter("hspec_requests_finished", "Generation requests finished, by reason",
                                         ["reason"], registry=r)
        self.prompt_tokens = Counter("hspec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("hspec_generation_tokens", "Output tokens generated", registry=r)
        self.prefill_tokens = Counter("hspec_prefill_tokens", "Positions prefilled, recomputes after preemption "
                                      "included", registry=r)
        self.preemptions = Counter("hspec_preemptions", "Sequences preempted (recomputed later)", registry=r)
        self.engine_steps = Counter("hspec_engine_steps", "Engine steps run", registry=r)
        self.decode_rows = Counter("hspec_decode_rows", "Sequences in the batched decoding steps, summed over "
                                   "steps (mean batch = this / engine steps)", registry=r)
        self.spec_steps = Counter("hspec_spec_decode_steps", "Speculative sequence-steps", registry=r)
        self.accepted = Counter("hspec_spec_decode_accepted_tokens", "Sequence-steps whose first k drafts were "
                                "all accepted, by block position k", ["position"], registry=r)
        self.verified = Counter("hspec_spec_decode_verified_tokens", "Sequence-steps that accepted their first "
                                "k-1 drafts and verified a k-th, by block position k", ["position"], registry=r)
        self.mean_accepted_length = Gauge("hspec_mean_accepted_length", "MAL tau = mean over sequence-steps of "
                                          "(accepted + 1), since start (1 for plain decoding)", registry=r)
        self.mean_accepted_length.set(1.0)
        self.kv_usage = Gauge("hspec_kv_cache_usage_fraction", "KV pool pages in use / total", registry=r)
        self.kv_usage_seconds = Counter("hspec_kv_cache_usage_seconds", "Time integral of the KV usage fraction "
                                        "(seconds)", registry=r)
        self.running = Gauge("hspec_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("hspec_num_requests_waiting", "Requests queued for admission", registry=r)
        # Running totals for the MAL gauge; only the engine thread writes them.
        self._steps = 0
        self._accepted_sum = 0

    def observe_step(self, report: StepReport) -> None:
        """Account one engine step (called by the engine thread)."""
        self.engine_steps.inc()
        self.decode_rows.inc(report.num_decoded)
        self.prefill_tokens.inc(report.num_prefill_tokens)
        self.generation_tokens.inc(report.num_new_tokens)
        self.preemptions.inc(report.num_preempted)
        drafted = [(n, d) for n, d in zip(report.num_accepted, report.num_drafted) if d > 0]  # (accepted, verified)
        if drafted:
            self.spec_steps.inc(len(drafted))
            for k in range(1, report.K + 1):
                self.accepted.labels(str(k)).inc(sum(1 for n, _ in drafted if n >= k))
                self.verified.labels(str(k)).inc(sum(1 for n, d in drafted if n >= k - 1 and d >= k))
            self._steps += len(drafted)
            self._accepted_sum += sum(n for n, _ in drafted)
            self.mean_accepted_length.set(1.0 + self._accepted_sum / self._steps)
        for update in report.updates:
            if update.finished:
                self.requests_finished.labels(update.finish_reason).inc()
        self.observe_load(report.kv_usage, report.num_running, report.num_waiting)

    def observe_load(self, kv_usage: float, num_running: int, num_waiting: int) -> None:
        self.kv_usage.set(kv_usage)
        self.running.set(num_running)
        self.waiting.set(num_waiting)

    def observe_time(self, seconds: float, kv_usage: float) -> None:
        """Add `seconds` of wall-clock time spent at `kv_usage` to the usage integral."""
        self.kv_usage_seconds.inc(seconds * kv_usage)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
