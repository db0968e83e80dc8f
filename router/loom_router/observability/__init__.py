"""Observability: Prometheus metrics (one /metrics for every process), the request log, tracing."""
