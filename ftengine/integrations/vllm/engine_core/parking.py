"""Parking: a faulted engine core whose vLLM recovery deadline is lifted, so vLLM's
``fault_tolerant_wrapper`` waits for it with no end (until it resumes, or SIGTERM).

vLLM's wrapper, after ``on_fault``, waits ``ft_sentinel.resumed.wait(timeout=
engine_recovery_timeout_sec)`` and re-raises at the deadline: the engine core exits, and its
API server with it. Two engines must outlive that: DP rank 0 when it hosts the DP
coordinator (``coordinator_host.py``) and a partition's minority waiting for the link
(``minority.py``). The minority may learn that it is cut off only after the wait began, so
the deadline cannot be a value read once: ftengine gives the sentinel a ``resumed`` event
(:class:`ParkableEvent`, installed as the sentinel is built; vLLM only ``set``s, ``clear``s
and ``wait``s it) whose wait ends at its timeout unless :func:`park` was called meanwhile,
before or during the wait. ``set`` (the engine resumed) unparks it: the next fault has
vLLM's deadline again.
"""

from __future__ import annotations

import inspect
import threading
import time
from typing import Any

from ftengine.integrations.vllm.messages import import_vllm

SENTINEL_MODULE = "vllm.v1.fault_tolerance.engine_core_sentinel"
WAIT_SOURCE = "self.ft_sentinel.resumed.wait("
"""What vLLM's wrapper must call for parking to take effect (checked: :func:`seam_present`)."""
POLL_S = 0.25  # how often a bounded wait looks whether it was parked


class ParkableEvent(threading.Event):
    """A ``threading.Event`` whose bounded ``wait`` is lifted by :meth:`park`."""

    def __init__(self) -> None:
        super().__init__()
        self.parked = False

    def park(self) -> None:
        self.parked = True

    def set(self) -> None:
        self.parked = False
        super().set()

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            return super().wait()
        deadline = time.monotonic() + timeout
        while True:
            left = POLL_S if self.parked else deadline - time.monotonic()
            if left <= 0:
                return self.is_set()
            if super().wait(min(left, POLL_S)):
                return True


def install(sentinel: Any) -> None:
    """Give vLLM's new ``EngineCoreSentinel`` a :class:`ParkableEvent` as ``resumed``, in
    the state its own was in."""
    event = ParkableEvent()
    if sentinel.resumed.is_set():
        event.set()
    sentinel.resumed = event


def seam_present() -> bool:
    """Whether vLLM's wrapper still waits on the sentinel's ``resumed`` (else parking would
    silently do nothing; a unit test fails loudly when it moves)."""
    wrapper = import_vllm(SENTINEL_MODULE).fault_tolerant_wrapper
    return WAIT_SOURCE in inspect.getsource(wrapper)


def park(sentinel: Any) -> bool:
    """Lift ``sentinel``'s recovery deadline until it resumes; False (vLLM's deadline holds)
    when its ``resumed`` is not ftengine's or vLLM's wrapper no longer waits on it."""
    event = getattr(sentinel, "resumed", None)
    if not isinstance(event, ParkableEvent) or not seam_present():
        return False
    event.park()
    return True
