"""What runs in vLLM's worker process: ftengine's fault adapter, the worker's backend and
hooks, the CPU platform's expert re-hosting and collectives."""
