"""The multi-host launcher's network half without vLLM (root, iproute2): hosts on a bridge
that reach each other and the root namespace; a partition that silences the paths between
two sides (no error, no reset) while the root namespace still reaches both; heal; the
machine's hostname resolving to each host's own address inside it; and a teardown that
leaves no namespace, link or hosts file, also after a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ftengine.testbed.cluster.netns import Hosts
from ftengine.testbed.vllm.hosts import HostLayout, MultiHostDeployment, leftovers

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]

CONNECT = (
    "import socket, sys\n"
    "s = socket.socket(); s.settimeout(0.5)\n"
    "try:\n"
    "    s.connect((sys.argv[1], 9)); print('open')\n"
    "except ConnectionRefusedError: print('refused')\n"
    "except OSError: print('silent')\n"
)


def reach(namespace: str | None, address: str) -> str:
    """'refused' (a host answered: nothing listens on port 9) or 'silent' (no answer)."""
    argv = [sys.executable, "-c", CONNECT, address]
    if namespace is not None:
        argv = ["ip", "netns", "exec", namespace, *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()


def resolved(namespace: str) -> str:
    code = "import socket; print(socket.gethostbyname(socket.gethostname()))"
    argv = ["ip", "netns", "exec", namespace, sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip()


@pytest.mark.timeout(120)
def test_partition_silences_the_sides_not_the_clients_and_heals() -> None:
    spread = MultiHostDeployment(Hosts(3), HostLayout((1, 2, 1)))
    tag = spread.hosts.tag
    try:
        spread.hosts.create()
        spread._write_hosts_files()
        ns, address = spread.hosts.namespaces, spread.address
        assert reach(ns[0], address(2)) == "refused"  # reachable: the host answers
        assert [resolved(n) for n in ns] == [address(h) for h in range(3)]
        spread.partition([0, 1], [2])
        assert reach(ns[0], address(2)) == "silent"
        assert reach(ns[2], address(1)) == "silent"
        assert reach(ns[0], address(1)) == "refused"  # within a side: untouched
        assert reach(None, address(2)) == "refused"  # the clients still reach both sides
        assert reach(None, address(0)) == "refused"
        spread.heal()
        assert reach(ns[0], address(2)) == "refused"
        spread.link_down(1)
        assert reach(None, address(1)) == "silent"
        spread.heal()
        assert reach(None, address(1)) == "refused"
    finally:
        spread.stop()
    assert leftovers(tag) == []


@pytest.mark.timeout(120)
def test_a_failed_start_leaves_nothing(tmp_path: Path) -> None:
    from ftengine.testbed.vllm import hosts as hosts_module
    from ftengine.testbed.vllm.launcher import DeploymentConfig
    from ftengine.weights.checkpoint_gen import make_checkpoint

    made: list[MultiHostDeployment] = []
    folders: list[Path] = []
    original = MultiHostDeployment._write_hosts_files

    def then_fail(self: MultiHostDeployment) -> None:
        made.append(self)
        original(self)
        folders.extend(self.hosts_files)
        raise RuntimeError("failed while starting")

    checkpoint = make_checkpoint(
        f"{tmp_path}/model", layers=1, experts=2, hidden=16, intermediate=8
    )
    config = DeploymentConfig(checkpoint, dp_size=2, log_dir=f"{tmp_path}/logs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hosts_module.MultiHostDeployment, "_write_hosts_files", then_fail)
        with pytest.raises(RuntimeError, match="failed while starting"):
            MultiHostDeployment.start(config, HostLayout((1, 1)))
    assert made and leftovers(made[0].hosts.tag) == []
    assert len(folders) == 2 and not any(p.exists() for p in folders)
