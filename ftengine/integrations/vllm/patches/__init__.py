"""The vLLM names ftengine replaces, by the process they run in, and how they are replaced."""
