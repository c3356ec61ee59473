"""``ftengine bench recovery`` end to end on a tiny checkpoint: one process, every headline
JSON field set, outputs checked after the scale-down, the plot written, two launches per
side in the overhead rounds, and no process of its session left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from ftengine.weights.checkpoint_gen import make_checkpoint

pytestmark = pytest.mark.integration

SIZES: dict[str, Any] = {"layers": 2, "experts": 8, "hidden": 64, "intermediate": 32}
FIELDS = (
    "sigkill_detect_s",
    "sigstop_detect_s",
    "op_timeout_s",
    "scale_down_interruption_s",
    "full_restart_s",
    "interruption_over_restart",
    "retry_s",
    "ft_overhead_ratio",
    "reloads",
    "reload_lower_bound",
    "bytes_reloaded",
    "outputs_match",
)


def _session(sid: int) -> list[str]:
    """The command lines of the live processes in session ``sid``."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getsid(process.pid) == sid and process.status() != psutil.STATUS_ZOMBIE:
                found.append(" ".join(process.cmdline()))
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return found


def _session_after_exits(sid: int, grace_s: float = 10.0) -> list[str]:
    """``_session(sid)`` once processes the kernel is still tearing down are gone.

    A SIGKILLed worker whose parent has exited is reparented and may still be unmapping its
    memory (its command line already reads empty) for a moment after the bench returns;
    a real orphan is still there after ``grace_s``.
    """
    deadline = time.monotonic() + grace_s
    found = _session(sid)
    while found and time.monotonic() < deadline:
        time.sleep(0.2)
        found = _session(sid)
    return found


@pytest.mark.timeout(300)
def test_bench_recovery_runs_every_measurement_on_a_tiny_checkpoint(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ckpt", **SIZES)
    flags = [f"--{name}={value}" for name, value in SIZES.items()]
    plot = tmp_path / "recovery.png"
    command = [sys.executable, "-m", "ftengine", "bench", "recovery", "--json"]
    command += ["--checkpoint", str(checkpoint), *flags, "--plot", str(plot)]
    command += ["--kill-trials", "2", "--stop-trials", "1", "--settle", "0.1"]
    command += ["--overhead-rounds", "2", "--overhead-tokens", "2", "--overhead-launches", "2"]
    command += ["--op-timeout", "2"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, err.decode(errors="replace")[-3000:]
    result = json.loads(out)
    for field in FIELDS:
        assert result[field] is not None, field
    assert result["outputs_match"] is True
    assert result["reloads"] >= result["reload_lower_bound"]
    assert result["sigkill_detect_s"]["n"] == 2 and result["sigstop_detect_s"]["n"] == 1
    assert result["ft_overhead_launches"] == 2
    assert set(result["ft_overhead_launch_ratios"]) == {
        "on0/off0",
        "on0/off1",
        "on1/off0",
        "on1/off1",
    }
    assert set(result["ft_overhead_same_mode_ratios"]) == {"on0/on1", "off0/off1"}
    assert plot.stat().st_size > 0 and result["plot"] == str(plot)
    # Every cluster it launched was shut down with it: nothing of its session survives.
    assert _session_after_exits(process.pid) == []
