"""Stand-in package (see ``vllm_ascend``)."""
