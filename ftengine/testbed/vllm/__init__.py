"""Real vLLM under test: the launcher of external-LB deployments, the demo and its checks,
and the vLLM adapter for the CPU cluster's workers."""
