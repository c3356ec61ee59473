"""A worker's DP groups: a rebuilt group's members wait for rank 0's rendezvous store
instead of letting torch's client back off (``ftengine/integrations/vllm/rendezvous.py``),
and a closed group is let go of at once (``worker/distributed.py``)."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from typing import Any

import pytest

from ftengine.integrations.vllm import rendezvous
from ftengine.integrations.vllm.worker import distributed


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_it_returns_once_a_server_listens_and_false_when_none_comes() -> None:
    port = free_port()
    server = socket.socket()

    def listen() -> None:
        server.bind(("127.0.0.1", port))
        server.listen()

    opened = threading.Timer(0.2, listen)
    opened.start()
    try:
        assert rendezvous.await_store("127.0.0.1", port, timedelta(seconds=10))
    finally:
        opened.join()
        server.close()
    assert not rendezvous.await_store("127.0.0.1", free_port(), timedelta(seconds=0.05))


def test_a_torch_store_it_waited_for_still_serves_its_real_clients() -> None:
    """The probe's bare connection is one the store must shrug off (it sends nothing)."""
    torch_dist = pytest.importorskip("torch.distributed")
    port = free_port()
    master = torch_dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=10),
                                 wait_for_workers=False)  # fmt: skip
    assert rendezvous.await_store("127.0.0.1", port, timedelta(seconds=5))
    client = torch_dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert master.get("k") == b"v"


@pytest.mark.parametrize(("rank", "waits"), [(0, False), (1, True), (2, True)])
def test_every_member_but_rank_0_waits_before_vllms_init(
    monkeypatch: pytest.MonkeyPatch, rank: int, waits: bool
) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(distributed, "await_store", lambda *a: calls.append(("wait", a)))
    vllm = type("V", (), {})()
    vllm.stateless_init_torch_distributed_process_group = lambda *a, **k: calls.append(("init", a))
    monkeypatch.setattr(distributed, "import_vllm", lambda name: vllm)
    distributed.RealVllmDistributed().init_gloo_group("h", 7, rank, 3, timedelta(seconds=4))
    expected = [("wait", ("h", 7, timedelta(seconds=4)))] if waits else []
    assert calls == [*expected, ("init", ("h", 7, rank, 3))]


class Group:
    """Stands for a ProcessGroup: only its references matter here."""


def test_closing_groups_keeps_no_reference_to_any_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every group is let go of before the count (a loop variable once kept the last one
    open until the caller returned, and the worker logged a false "still referenced")."""
    destroyed: list[str] = []
    monkeypatch.setattr(
        distributed.RealVllmDistributed, "destroy_group", lambda self, g: destroyed.append("x")
    )
    groups: list[object] = [Group(), Group()]
    assert distributed.RealVllmDistributed().close_groups(groups) == 0
    assert groups == [] and len(destroyed) == 2
    kept = Group()
    assert distributed.RealVllmDistributed().close_groups([Group(), kept]) == 1
