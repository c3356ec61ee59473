"""Operator surface: vLLM-compatible control API, health and metrics."""
