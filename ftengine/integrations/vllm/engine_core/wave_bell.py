"""DP waves without vLLM's DP coordinator, once DP rank 0 is removed.

In external-LB mode vLLM's engines step together only while a *wave* runs: an idle engine
that gets a request starts stepping, and the others join because DP rank 0's API server
(the DP coordinator) tells them (``START_DP_WAVE``, sent on the API client's ``FIRST_REQ``
or the engine's ``start_wave``). When rank 0's host is lost, the coordinator is lost with it:
the engine with the request would step alone and wait in its first collective for peers
that never come. So, once DP rank 0 is removed, an engine that gets a request while idle
(``DPEngineCoreProc.add_request``, patched) rings every member's :class:`WaveBell` itself
with vLLM's own message, ``(wave, exclude)``; each bell's thread puts ``START_DP_WAVE`` into
its engine core's input queue, exactly where the coordinator's would land, so vLLM's
``_handle_client_request`` decides as it always does (a stale wave is ignored, a running
engine stays running). While rank 0's server still runs the coordinator (rank 0 removed
for a worker of its own that died), both wake the peers; a second wake-up for the same
wave is a no-op.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ftengine.integrations.vllm.engine_core.scale_down import AGENT_ATTR

logger = logging.getLogger(__name__)

COORDINATOR_RANK = 0
"""The DP rank whose API server runs vLLM's DP coordinator (external LB)."""
ENGINE_MODULE = "vllm.v1.engine"


class WaveBell:
    """A UDP socket on every interface and the thread that turns each ring into
    ``START_DP_WAVE`` on ``put`` (the engine core's input queue)."""

    def __init__(self, host: str, put: Callable[[tuple[Any, Any]], None]) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.address = (host, int(self.sock.getsockname()[1]))
        self._put = put
        self._closed = threading.Event()
        self.thread = threading.Thread(target=self._listen, name="ftengine-waves", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self._closed.set()
        if self.thread.is_alive():
            with contextlib.suppress(OSError):
                self.sock.sendto(b"", ("127.0.0.1", self.address[1]))  # wakes the thread
            self.thread.join(timeout=1.0)
        self.sock.close()

    def _listen(self) -> None:
        start_wave = import_start_wave()
        while not self._closed.is_set():
            try:
                raw = self.sock.recv(256)
            except OSError:
                return
            found = decode(raw)
            if found is not None:
                self._put((start_wave, found))

    def ring(self, addresses: Iterable[tuple[str, int]], wave: int, exclude: int) -> None:
        """Tell the bells at ``addresses`` that wave ``wave`` began on engine ``exclude``."""
        payload = json.dumps([wave, exclude]).encode()
        for address in addresses:
            with contextlib.suppress(OSError):  # a peer gone: its recovery, not this wave's
                self.sock.sendto(payload, address)


def decode(raw: bytes) -> tuple[int, int] | None:
    """A ring's ``(wave, exclude)``, or None for anything else (the close's empty datagram,
    a stray packet)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, list) or len(value) != 2:
        return None
    if not all(type(v) is int for v in value):
        return None
    return int(value[0]), int(value[1])


def import_start_wave() -> Any:
    """vLLM's ``EngineCoreRequestType.START_DP_WAVE``."""
    from ftengine.integrations.vllm.messages import import_vllm

    return import_vllm(ENGINE_MODULE).EngineCoreRequestType.START_DP_WAVE


def started_idle(engine: Any, was_running: bool) -> None:
    """After vLLM's ``DPEngineCoreProc.add_request``: this engine was idle, so a wave begins
    here; with DP rank 0 removed (the coordinator may be gone) its members are rung."""
    if was_running:
        return
    sentinel = getattr(engine, "ft_sentinel", None)
    agent = getattr(sentinel, AGENT_ATTR, None)
    if agent is None:
        return
    agent.ring_wave(int(engine.current_wave), int(engine.engine_index))
