"""No status file is left behind: a worker writes one only under a vLLM engine core, and the
files of engine cores that no longer run are removed (by each agent at start, and by the
launcher on stop)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ftengine.integrations.vllm import status_file
from ftengine.integrations.vllm.status_file import StatusFile, remove_dead_status_files
from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment


@pytest.fixture
def tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    return tmp_path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_worker_whose_parent_is_no_vllm_engine_core_gets_no_status_file(tmp_dir: Path) -> None:
    assert StatusFile.for_worker(0) is None  # pytest's parent is a shell, not VLLM::EngineCore
    assert list(tmp_dir.iterdir()) == []


def test_a_worker_under_an_engine_core_writes_its_parents_file(
    tmp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []

    def is_engine_core(pid: int) -> bool:
        seen.append(pid)
        return True

    monkeypatch.setattr(status_file, "_is_engine_core", is_engine_core)
    assert StatusFile.for_worker(1) == StatusFile(
        tmp_dir / f"ftengine-status-{os.getppid()}-1.json"
    )
    assert seen == [os.getppid()]


def test_the_engine_core_title_check_reads_the_process_title() -> None:
    assert not status_file._is_engine_core(_dead_pid())
    assert not status_file._is_engine_core(os.getpid())


def test_files_of_dead_engine_cores_are_removed_and_live_ones_kept(tmp_dir: Path) -> None:
    dead, live = _dead_pid(), StatusFile.for_engine_core(0)
    live.write({"phase": "running"})
    stale = [
        tmp_dir / f"ftengine-status-{dead}-0.json",
        tmp_dir / f"ftengine-status-{dead}-1.{dead}.partial",  # killed while writing
    ]
    for path in stale:
        path.write_text("{}")
    other = tmp_dir / "ftengine-status-notes.txt"  # not a status file's name: kept
    other.write_text("")
    assert sorted(remove_dead_status_files()) == sorted(stale)
    assert sorted(tmp_dir.iterdir()) == sorted([live.path, other])


def test_the_launcher_removes_the_files_of_engine_cores_that_died_before_stop(
    tmp_dir: Path,
) -> None:
    checkpoint = tmp_dir / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    deployment = VllmDeployment(DeploymentConfig(checkpoint), [])
    deployment.started_pids = {_dead_pid()}  # seen at start-up, SIGKILLed since
    (tmp_dir / f"ftengine-status-{next(iter(deployment.started_pids))}-0.json").write_text("{}")
    deployment.stop()
    assert sorted(p.name for p in tmp_dir.iterdir()) == ["ckpt"]
