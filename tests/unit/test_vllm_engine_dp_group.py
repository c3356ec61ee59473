"""The engine cores' DP group let go of on a fault (``engine_core/dp_group.py``), with real
gloo groups: a peer blocked in the group's all-reduce fails at once, not at the op timeout;
vLLM's own destroy (a retry's ``_reinit_dp_group``, shutdown) accepts what stands in its
place, and a collective on that raises."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ftengine.integrations.vllm.engine_core.dp_group import ClosedDpGroup, close_dp_group
from tests.vllm_support import free_port_run

utils = pytest.importorskip("vllm.distributed.utils", reason="vllm is not installed")

OP_TIMEOUT = timedelta(seconds=30)


def pair_of_groups() -> list[object]:
    """Two engine cores' DP groups (ranks 0 and 1 of one gloo group), built as vLLM builds
    them (``stateless_init_torch_distributed_process_group``), each on its own thread."""
    port, groups = free_port_run(1), [None, None]

    def build(rank: int) -> None:
        groups[rank] = utils.stateless_init_torch_distributed_process_group(
            "127.0.0.1", port, rank, 2, backend="gloo", timeout=OP_TIMEOUT
        )

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(g is not None for g in groups)
    return groups  # type: ignore[return-value]


def test_a_peer_waiting_in_the_all_reduce_fails_at_once_when_the_faulted_one_lets_go() -> None:
    groups = pair_of_groups()
    engine = SimpleNamespace(dp_group=groups[0])
    waiting = groups[1]
    groups.clear()  # the engine holds rank 0's group alone, as vLLM's engine core does
    failed: list[BaseException] = []
    took: list[float] = []

    def peer() -> None:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.zeros(2), group=waiting)
        except RuntimeError as exc:
            failed.append(exc)
        took.append(time.monotonic() - start)

    thread = threading.Thread(target=peer)
    thread.start()
    time.sleep(0.3)  # the peer is in the all-reduce, rank 0 never joins it
    assert close_dp_group(engine, 0, RuntimeError("the step raised"))
    thread.join(OP_TIMEOUT.total_seconds())
    assert failed and "Connection closed by peer" in str(failed[0]), failed
    assert took[0] < OP_TIMEOUT.total_seconds() / 2, took  # not the op timeout
    assert isinstance(engine.dp_group, ClosedDpGroup)
    assert not close_dp_group(engine, 0)  # closed already
    utils.stateless_destroy_torch_distributed_process_group(waiting)


def test_what_stands_in_takes_vllms_destroy_and_refuses_collectives() -> None:
    closed = ClosedDpGroup(1)
    utils.stateless_destroy_torch_distributed_process_group(closed)  # a retry's first act
    with pytest.raises(RuntimeError, match=r"engine 1's DP group was closed after a fault"):
        dist.all_reduce(torch.zeros(2), group=closed)
    assert not hasattr(closed, "__deepcopy__")  # probes see no attribute, not an error


def test_an_engine_without_a_dp_group_has_nothing_to_close() -> None:
    assert not close_dp_group(SimpleNamespace(), 0)


class Group:
    """What vLLM's destroy needs of a group (the real one: the test above)."""

    group_name = "test-engine-dp"

    def shutdown(self) -> None:
        pass


def test_the_group_is_let_go_of_before_vllm_makes_the_engine_unhealthy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once vLLM's ``on_fault`` has made the engine UNHEALTHY, the agent's recovery may
    start on its own thread and rebuild the group: closing after that closed the new group
    (seen: the recovered peers faulted again and rank 0 never recovered)."""
    from ftengine.integrations.vllm.engine_core import reinference
    from ftengine.integrations.vllm.patches import engine_core as patches
    from tests.unit.test_vllm_engine_agent import Sentinel, Status, agent_for

    sentinel = Sentinel(rank=1, world=3)
    setattr(sentinel, patches.AGENT_ATTR, agent_for(sentinel, "auto"))
    sentinel.engine.dp_group = Group()
    seen: list[object] = []

    def vllm_on_fault(self: Sentinel, exc: BaseException) -> None:
        seen.append(self.engine.dp_group)
        self.status_type = Status.UNHEALTHY

    monkeypatch.setattr(reinference, "hold_or_abort", lambda s, e, on_fault, _: on_fault(s, e))
    patches._agent_on_fault(vllm_on_fault)(sentinel, RuntimeError("the step raised"))
    assert len(seen) == 1 and isinstance(seen[0], ClosedDpGroup)
