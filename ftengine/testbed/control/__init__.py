"""Operator surface: vLLM-compatible fault-tolerance API, OpenAI completions, health and metrics."""
