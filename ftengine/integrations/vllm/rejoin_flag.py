"""How a restarted DP rank knows it rejoins a running deployment (issue 28).

DP rank 0's API server answers a restarted rank's start-up handshake after start-up
(``api_server/rejoin_responder.py``) with vLLM's own init message plus one key,
:data:`REJOIN_KEY`, in its ``parallel_config`` dict. vLLM's engine core copies every key of
that dict onto its ``ParallelConfig`` (``EngineCoreProc.startup_handshake``: ``setattr``), so
the flag reaches the engine core's ``ParallelConfig`` and, pickled with it, the worker's. An
attribute that is no dataclass field changes neither ``compute_hash()`` nor any vLLM
behaviour; ftengine's engine-core and worker patches read it.
"""

from __future__ import annotations

REJOIN_KEY = "ftengine_rejoin"
"""The key rank 0's rejoin responder adds to the handshake's ``parallel_config`` (value 1)."""


def rejoining(parallel_config: object) -> bool:
    """Whether this process belongs to a restarted rank that rejoins a running deployment."""
    return bool(getattr(parallel_config, REJOIN_KEY, 0))
