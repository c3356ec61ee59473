"""What runs in vLLM's engine-core process: the agent beside ``EngineCoreSentinel``, the DP
status board, re-inference, poison probe, hand-off and scale-down."""
