"""The example orchestrator (``examples/ft_orchestrator.py``, standard library only, written
against vLLM's REST API) drives a real ``ftengine serve`` through the seed's two scenarios:
an injected fault recovered by retry, and a killed rank whose retry is rejected before the
survivors scale down past it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ftengine.weights.checkpoint_gen import make_checkpoint
from tests.integration.serve_support import SIZES, Server, Starter, clean_env

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "ft_orchestrator.py"
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("orchestrator-ckpt") / "model", **SIZES)


@pytest.fixture
def start(tmp_path: Path, checkpoint: Path) -> Iterator[Starter]:
    starter = Starter(tmp_path, checkpoint)
    yield starter
    starter.stop_all()


def orchestrator(server: Server, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, str(SCRIPT), "--server", server.url, *extra]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env()
    )


def finish(process: subprocess.Popen[str]) -> tuple[dict[str, Any], str]:
    try:
        out, err = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"the orchestrator did not finish: {err[-3000:]}") from None
    assert process.returncode == 0, f"{out}\n{err[-3000:]}"
    return dict(json.loads(out)), err


@pytest.mark.timeout(300)
def test_scenario_1_injected_fault_then_retry_on_every_rank(start: Starter) -> None:
    # The orchestrator's own probes drive the steps; the fault fires at step 12.
    server = start("--inject-fault", "rank=3,step=12,kind=raise")
    report, log = finish(orchestrator(server, "--expect", "retry"))
    assert report["scenario"] == "retry" and report["dead"] == []
    assert set(report["faulted"].values()) == {"unhealthy"}
    assert report["answers_match"] is True
    assert len(report["commands"]) == 1 and len(report["commands"][0]["request_ids"]) == 1
    assert "retry {} -> " in log
    assert all(e["status"] == "healthy" and e["epoch"] == 1 for e in server.engines().values())


@pytest.mark.timeout(300)
def test_scenario_2_killed_rank_retry_rejected_then_scale_down(start: Starter) -> None:
    server = start()
    process = orchestrator(server, "--expect", "scale_down")
    assert process.stderr is not None
    for line in process.stderr:  # the baseline answers are in: the fault may come
        if "watching for a fault" in line:
            break
    else:
        raise AssertionError(f"the orchestrator stopped early: {process.communicate()}")
    victim = server.engines()[3]["pid"]
    assert victim in server.descendants  # only ever our own server's worker
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    report, _ = finish(process)
    assert report["scenario"] == "scale_down" and report["dead"] == [3]
    assert "status is DEAD" in report["retry_to_victim"]["3"]
    assert report["commands"][0]["params"] == {"removed_dp_ranks": [3]}
    assert report["removed_ranks"] == [3] and report["answers_match"] is True
    engines = server.engines()
    assert engines[3]["status"] == "dead"
    assert all(engines[r]["status"] == "healthy" for r in (0, 1, 2))
