"""The multi-host launcher's layout and placement: which host runs which rank, and each
rank's command line (its host's address, rank 0's host as vLLM's DP address, the
namespace wrapper, gloo on the host's link)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftengine.errors import ConfigError
from ftengine.testbed.cluster.netns import INNER_IF, Hosts
from ftengine.testbed.vllm.hosts import HostLayout, NamespacePlacement
from ftengine.testbed.vllm.launcher import DeploymentConfig


def test_layout_places_ranks_in_order() -> None:
    layout = HostLayout((1, 2, 1))
    assert layout.dp_size == 4 and layout.hosts == 3
    assert [layout.host_of(r) for r in range(4)] == [0, 1, 1, 2]
    assert layout.ranks_on(1) == (1, 2)
    assert HostLayout.even(4, 2) == HostLayout((2, 2))
    assert HostLayout.even(5, 3) == HostLayout((2, 2, 1))
    assert HostLayout.parse("2,1,1") == HostLayout((2, 1, 1))


@pytest.mark.parametrize("bad", [(), (0, 2), (2, -1)])
def test_layout_refuses_empty_hosts(bad: tuple[int, ...]) -> None:
    with pytest.raises(ConfigError, match="ranks per host"):
        HostLayout(bad)


def test_layout_refuses_bad_ranks_and_text() -> None:
    with pytest.raises(ConfigError):
        HostLayout((1, 1)).host_of(2)
    with pytest.raises(ConfigError):
        HostLayout.even(2, 3)
    with pytest.raises(ConfigError, match=r"e\.g\. '2,2'"):
        HostLayout.parse("two")


def test_each_rank_binds_its_host_and_names_rank_zeros_host(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    hosts = Hosts(2, tag="ftt00")  # not created: only its names and addresses are read
    placement = NamespacePlacement(hosts, HostLayout((1, 2)))
    config = DeploymentConfig(tmp_path, dp_size=3, port=8100, log_dir=tmp_path / "logs")
    argv = config.argv(2, 4321, placement)
    assert argv[argv.index("--host") + 1] == hosts.address(1)
    assert argv[argv.index("--port") + 1] == "8102"
    assert argv[argv.index("--data-parallel-address") + 1] == hosts.address(0)
    assert argv[argv.index("--data-parallel-rpc-port") + 1] == "4321"
    assert placement.command(2, argv)[:4] == ["ip", "netns", "exec", "ftt00n1"]
    assert placement.env(2) == {"GLOO_SOCKET_IFNAME": INNER_IF, "VLLM_HOST_IP": hosts.address(1)}
    assert config.url(2, placement) == f"http://{hosts.address(1)}:8102"
    plain = config.argv(2, 4321)  # no placement: the single-host deployment, unchanged
    assert plain[plain.index("--data-parallel-address") + 1] == "127.0.0.1"


def test_vllm_up_refuses_a_bad_layout_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ftengine.cli import main

    (tmp_path / "config.json").write_text("{}")
    base = ["vllm", "up", "--checkpoint", str(tmp_path), "--log-dir", str(tmp_path / "logs")]
    assert main([*base, "--dp", "2", "--layout", "two"]) == 1
    assert "ranks per host" in capsys.readouterr().err
    assert main([*base, "--dp", "2", "--layout", "1,2"]) == 1
    assert "the layout places 3 ranks, the config has dp_size 2" in capsys.readouterr().err
    assert main([*base, "--dp", "2", "--hosts", "3"]) == 1
    assert "hosts <= dp_size" in capsys.readouterr().err
