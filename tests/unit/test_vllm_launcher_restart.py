"""``VllmDeployment.restart``: a rank's server stopped (its process group) and started again
with its original command line and the deployment's rpc port, into a log of its own; the
other ranks untouched. Stand-in servers: a Python process that prints its argv and sleeps."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest

from ftengine.testbed.vllm import launcher
from ftengine.testbed.vllm.launcher import DeploymentConfig, Placement, VllmDeployment

SLEEPER = "import sys, time; print(' '.join(sys.argv[1:]), flush=True); time.sleep(120)"


@pytest.fixture
def deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> VllmDeployment:
    (tmp_path / "config.json").write_text("{}")

    def argv(
        self: DeploymentConfig, rank: int, rpc_port: int, placement: Placement | None = None
    ) -> list[str]:
        return [sys.executable, "-c", SLEEPER, f"rank={rank}", f"rpc={rpc_port}"]

    monkeypatch.setattr(DeploymentConfig, "argv", argv)
    config = DeploymentConfig(tmp_path, dp_size=2, log_dir=tmp_path / "logs")
    config.log_dir.mkdir()
    ranks = [launcher._spawn(config, r, 4321) for r in range(2)]
    return VllmDeployment(config, ranks, rpc_port=4321)


def printed(path: Path) -> str:
    deadline = time.monotonic() + 30
    while not path.read_text().strip():
        assert time.monotonic() < deadline, f"nothing printed to {path}"
        time.sleep(0.05)
    return path.read_text().strip()


def test_restart_stops_the_rank_and_starts_its_original_command_again(
    deployment: VllmDeployment,
) -> None:
    try:
        old, other = deployment.ranks[1].process, deployment.ranks[0].process
        new = deployment.restart(1)
        assert not psutil.pid_exists(old.pid) or psutil.Process(old.pid).status() == "zombie"
        assert old.poll() is not None and other.poll() is None  # rank 0 untouched
        assert new is deployment.ranks[1] and new.process.poll() is None
        assert new.log_path.name == "rank1.restart1.log"
        assert printed(new.log_path) == "rank=1 rpc=4321"  # same command, same rpc port
        assert printed(deployment.ranks[0].log_path) == "rank=0 rpc=4321"
        assert deployment.restart(1).log_path.name == "rank1.restart2.log"
    finally:
        deployment.stop()
    assert all(rank.process.poll() is not None for rank in deployment.ranks)


IPC_SLEEPER = (
    "import os, socket, sys, time; d = os.environ['VLLM_RPC_BASE_PATH']; "
    "socket.socket(socket.AF_UNIX).bind(os.path.join(d, sys.argv[1])); print(d, flush=True); "
    "time.sleep(120)"
)


def test_the_ranks_ipc_sockets_live_in_the_deployments_directory_removed_at_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM binds its ``ipc://`` sockets under ``VLLM_RPC_BASE_PATH``; a SIGKILLed server
    leaves them behind. Each rank (a restarted one too) gets the deployment's directory, and
    ``stop`` removes it with whatever the killed processes left there."""
    (tmp_path / "config.json").write_text("{}")

    def argv(
        self: DeploymentConfig, rank: int, rpc_port: int, placement: Placement | None = None
    ) -> list[str]:
        return [sys.executable, "-c", IPC_SLEEPER, f"rank{rank}-{time.monotonic_ns()}"]

    monkeypatch.setattr(DeploymentConfig, "argv", argv)
    monkeypatch.delenv(launcher.RPC_PATH_ENV, raising=False)
    config = DeploymentConfig(tmp_path, dp_size=2, log_dir=tmp_path / "logs")
    config.log_dir.mkdir()
    rpc_dir = tmp_path / "rpc"
    rpc_dir.mkdir()
    ranks = [launcher._spawn(config, r, 4321, rpc_dir=rpc_dir) for r in range(2)]
    deployment = VllmDeployment(config, ranks, rpc_port=4321, rpc_dir=rpc_dir)
    try:
        assert printed(ranks[0].log_path) == printed(ranks[1].log_path) == str(rpc_dir)
        assert printed(deployment.restart(1).log_path) == str(rpc_dir)
        assert len(list(rpc_dir.iterdir())) == 3  # the killed rank 1's socket is still there
    finally:
        deployment.stop()
    assert not rpc_dir.exists()
