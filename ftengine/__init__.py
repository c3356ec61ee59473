"""ftengine: turn a dead rank in DP+EP MoE serving into a handled, recovered fault."""

__version__ = "0.1.0"
