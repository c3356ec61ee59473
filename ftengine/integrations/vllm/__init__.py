"""ftengine inside a vLLM worker: plugin and worker-sentinel adapter."""
