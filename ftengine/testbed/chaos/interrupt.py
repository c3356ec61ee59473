"""Running a campaign so that SIGINT / SIGTERM stop injecting but still report: the faults
run so far and the census of leftovers are never lost, nor is an error that ended it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Protocol

from ftengine.testbed.chaos.census import Leftovers


class Census(Protocol):
    def leftovers(self) -> Leftovers: ...


class Interruptible(Protocol):
    """What the cluster's and the vLLM campaign share for this."""

    interrupted: threading.Event
    error: str | None

    @property
    def census(self) -> Census: ...

    def run(self) -> None: ...


def run_until_interrupted(campaign: Interruptible, progress: Callable[[str], None]) -> Leftovers:
    """Run ``campaign`` with SIGINT / SIGTERM setting ``interrupted``; an exception is kept
    in ``error``; the previous handlers come back; the leftovers census after everything."""

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        progress(f"signal {signum}: no more faults; ending the campaign cleanly")
        campaign.interrupted.set()

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        campaign.run()
    except Exception as exc:  # reported with everything measured so far, never lost
        progress(f"campaign ended early: {exc!r}")
        campaign.error = f"{type(exc).__name__}: {exc}"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return campaign.census.leftovers()
