"""The test bed's opt-in nap for vLLM's queue waits (``ftengine.testbed.vllm.cpu_wait``): a
rank started with ``cpu_nap`` has ``os.sched_yield`` replaced in every Python process, and
vLLM still waits through ``os.sched_yield`` (this fails when vLLM waits some other way)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from ftengine.testbed.vllm.cpu_wait import DIR_NAME, NAP_S, with_nap
from ftengine.testbed.vllm.launcher import DeploymentConfig, rank_env

pytestmark = pytest.mark.timeout(60)


def test_a_rank_with_cpu_nap_naps_instead_of_yielding(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    config = DeploymentConfig(checkpoint, log_dir=tmp_path / "logs", cpu_nap=True)
    env = rank_env(config, 0, {"PATH": "/usr/bin:/bin", "PYTHONPATH": "/elsewhere"})
    first, rest = env["PYTHONPATH"].split(":", 1)
    assert Path(first) == (tmp_path / "logs" / DIR_NAME).resolve() and rest == "/elsewhere"
    probe = "import os, time; t = time.perf_counter(); os.sched_yield(); " \
            "print(os.sched_yield.__name__, time.perf_counter() - t)"  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "_nap" and float(out[1]) >= NAP_S
    off = rank_env(DeploymentConfig(checkpoint, log_dir=tmp_path / "logs"), 0, {"PATH": "/bin"})
    assert "PYTHONPATH" not in off  # vLLM's own waits unless asked


def test_the_nap_keeps_an_existing_pythonpath_or_makes_one(tmp_path: Path) -> None:
    assert with_nap({}, tmp_path)["PYTHONPATH"] == str((tmp_path / DIR_NAME).resolve())


def test_vllm_still_waits_through_os_sched_yield() -> None:
    import vllm.distributed.device_communicators.shm_broadcast as shm
    import vllm.distributed.utils as utils

    assert vars(shm)["sched_yield"] is utils.sched_yield  # the queue's waits: vLLM's helper
    assert "sched_yield()" in inspect.getsource(shm.SpinCondition.wait)
    assert "os.sched_yield()" in inspect.getsource(utils.sched_yield)  # looked up per call
