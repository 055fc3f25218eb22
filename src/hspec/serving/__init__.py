"""Serving: the pure scheduler, the continuous-batching engine, its worker thread, the OpenAI-compatible
HTTP server and its Prometheus metrics."""
