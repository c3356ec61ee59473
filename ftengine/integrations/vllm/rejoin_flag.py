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
RANK0_URL_KEY = "ftengine_rank0_url"
"""The key with DP rank 0's API server URL (when it has one): the returning rank reads the
survivors' DP store from that server's status (``engine_core/announce.py``)."""


def rank0_url(parallel_config: object) -> str | None:
    """DP rank 0's API server URL as its rejoin responder handed it over, or None."""
    url = getattr(parallel_config, RANK0_URL_KEY, None)
    return url if isinstance(url, str) and url else None


def rejoining(parallel_config: object) -> bool:
    """Whether this process belongs to a restarted rank that rejoins a running deployment."""
    return bool(getattr(parallel_config, REJOIN_KEY, 0))
