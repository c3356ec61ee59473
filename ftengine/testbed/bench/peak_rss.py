"""Peak resident-memory measurement of this process over a block of code (for benchmarks).

On Linux the kernel's own high-water mark is reset (``/proc/self/clear_refs`` = 5) and read
back (``VmHWM``), which sees every page however briefly it was resident; elsewhere a psutil
sampling thread approximates it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import psutil

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def _reset_high_water_mark() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _high_water_mark() -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{_STATUS} has no VmHWM line")


class PeakRss:
    """``with PeakRss() as meter: ...`` then ``meter.delta`` = peak RSS minus RSS at entry (bytes).

    ``method`` says how the peak was found: "vmhwm" (kernel) or "sampled" (psutil thread).
    """

    def __init__(self, interval_s: float = 0.001) -> None:
        self._process = psutil.Process()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.method = "vmhwm"
        self.baseline = 0
        self.peak = 0

    @property
    def delta(self) -> int:
        """Peak RSS during the block minus RSS at its start, in bytes (never negative)."""
        return max(0, self.peak - self.baseline)

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self.baseline = self._process.memory_info().rss
        self.peak = self.baseline
        if not _reset_high_water_mark():
            self.method = "sampled"
            self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.peak = max(self.peak, _high_water_mark())
        self.peak = max(self.peak, self._process.memory_info().rss)
