"""The namespace hosts' bookkeeping without touching the machine: ``ip`` is replaced by a
recorder, so what a run creates, how a half-made set-up is undone (newest first) and that
teardown runs once are checked here; tests/integration/test_chaos_netns.py does it for real."""

from __future__ import annotations

import atexit

import pytest

from ftengine.errors import ConfigError
from ftengine.testbed.cluster import netns


class FakeIp:
    """Records every ``ip`` call; fails the ``fail_at``-th one (1-based) like iproute2."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.fail_at = fail_at

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeIp:
        """Stand in for ``ip``; keep this process's atexit and SIGTERM handlers untouched."""
        monkeypatch.setattr(netns, "_ip", self)
        monkeypatch.setattr(netns, "_chain_sigterm", lambda cleanup: None)
        monkeypatch.setattr(atexit, "register", lambda cleanup: cleanup)
        return self

    def __call__(self, *args: str) -> None:
        self.calls.append(args)
        if len(self.calls) == self.fail_at:
            raise ConfigError(f"'ip {' '.join(args)}' failed (2): RTNETLINK answers: File exists")


def test_every_name_carries_the_runs_tag_and_close_removes_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ip = FakeIp().install(monkeypatch)
    hosts = netns.Hosts(2, tag="fttest1").create()
    assert hosts.namespaces == ("fttest1n0", "fttest1n1")
    made = len(ip.calls)
    created = {a[2] for a in ip.calls if a[:2] in (("link", "add"), ("netns", "add"))}
    assert created == {"fttest1br", "fttest1h0", "fttest1h1", "fttest1n0", "fttest1n1"}
    hosts.close()
    hosts.close()  # idempotent: the second close does nothing
    undone = ip.calls[made:]
    assert undone == [
        ("link", "del", "fttest1h1"), ("netns", "del", "fttest1n1"),
        ("link", "del", "fttest1h0"), ("netns", "del", "fttest1n0"),
        ("link", "del", "fttest1br"),
    ]  # fmt: skip


def test_a_failed_setup_undoes_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    ip = FakeIp(fail_at=6).install(monkeypatch)  # bridge (3), netns, veth, then master fails
    with pytest.raises(ConfigError, match="File exists"):
        netns.Hosts(2, tag="fttest2").create()
    assert ip.calls[6:] == [
        ("link", "del", "fttest2h0"), ("netns", "del", "fttest2n0"), ("link", "del", "fttest2br")
    ]  # fmt: skip


def test_a_cut_takes_the_root_side_link_down_and_heal_brings_it_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ip = FakeIp().install(monkeypatch)
    hosts = netns.Hosts(3, tag="fttest3")
    hosts.cut(2)
    hosts.heal(2)
    assert ip.calls == [("link", "set", "fttest3h2", "down"), ("link", "set", "fttest3h2", "up")]
    assert hosts.address(2).endswith(".12") and hosts.host.endswith(".1")


def test_a_tag_too_long_for_link_names_is_refused() -> None:
    with pytest.raises(ConfigError, match="<= 9 characters"):
        netns.Hosts(2, tag="much-too-long")
