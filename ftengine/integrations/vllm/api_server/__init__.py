"""What runs in vLLM's API server process: ftengine's metrics and the FT router's checks."""
