"""The CPU reference cluster: real DP+EP MoE worker processes over gloo."""
