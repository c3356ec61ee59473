"""``ftengine bench inflight`` end to end on a tiny run (DP=2, 12 tokens): the JSON object
has every row and count; with re-inference on no request is lost and every streamed token is
exact, and without it the requests in flight at the fault are lost (so the benchmark can
tell the two apart); vLLM's rows say why they are not measured; nothing is left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_bench_recovery_cli import _session_after_exits

pytestmark = pytest.mark.integration

COUNTS = (
    "requests_total",
    "requests_completed",
    "requests_lost",
    "requests_in_flight_at_fault",
    "tokens_mismatched",
    "tokens_duplicated",
    "tokens_missing",
)


def _run(tmp_path: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "ftengine", "bench", "inflight", "--json"]
    command += ["--checkpoint", str(tmp_path / "ckpt"), "--dp-size", "2", "--tokens", "12"]
    command += ["--fault-step", "8"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = process.communicate(timeout=280)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, err.decode(errors="replace")[-3000:]
    assert _session_after_exits(process.pid) == []
    result: dict[str, Any] = json.loads(out)
    return result


@pytest.mark.timeout(320)
def test_bench_inflight_measures_every_cluster_row_side_by_side(tmp_path: Path) -> None:
    result = _run(tmp_path)
    assert result["benchmark"] == "inflight" and result["setup"]["dp_size"] == 2
    assert set(result["cluster"]) == {"retry", "scale_down"}
    for recovery, rows in result["cluster"].items():
        assert set(rows) == {"reinference", "no_reinference"}, recovery
        for row in rows.values():
            assert all(isinstance(row[key], int) for key in COUNTS), row
            assert row["requests_total"] == 6
            assert set(row["extra_latency_s"]) == {"median", "max", "n"}
        on, off = rows["reinference"], rows["no_reinference"]
        assert on["targets_met"] is True, (recovery, on)
        assert on["requests_completed"] == 6 and on["finish_reasons"] == {"length": 6}
        assert on["requests_in_flight_at_fault"] > 0
        assert on["extra_latency_s"]["n"] == on["requests_in_flight_at_fault"]
        assert on["extra_latency_s"]["max"] >= on["extra_latency_s"]["median"]
        assert off["requests_lost"] > 0 and off["targets_met"] is False, (recovery, off)
        # Every request in flight at the fault is lost as today's server loses them: aborted,
        # or (seen under load) a broken stream; only one refused before admission (503,
        # asked again after the recovery) or ended before the fault completes.
        lost = off["finish_reasons"].get("abort", 0) + off["finish_reasons"].get("error", 0)
        assert lost == off["requests_lost"] >= off["requests_in_flight_at_fault"] > 0, off
        assert set(off["finish_reasons"]) <= {"abort", "error", "length"}, off
        assert off["requests_completed"] <= 6 - off["requests_in_flight_at_fault"], off
    assert result["targets_met"] is True
    assert set(result["vllm"]) == {"retry", "retry_auto", "scale_down"}  # no --vllm-checkpoint
    for row in result["vllm"].values():
        assert row.startswith("not measured: pass --vllm-checkpoint"), result["vllm"]
