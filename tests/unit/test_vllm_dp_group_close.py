"""A worker whose step raised closes its DP group: a peer blocked in that group's collective
fails at once ("Connection closed by peer", a peer's fault), not at the op timeout, and the
retry's rebuild gives both ranks working groups again. Two processes over real gloo groups
made by vLLM's own ``stateless_init_torch_distributed_process_group``."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from ftengine.collective_errors import classify_exception
from ftengine.faults import FaultKind
from ftengine.integrations.vllm.worker.distributed import RealVllmDistributed
from ftengine.integrations.vllm.worker.hooks import VllmWorkerHooks

pytest.importorskip("vllm.distributed", reason="vllm is not installed")

OP_TIMEOUT_S = 30.0
CLOSE_AFTER_S = 0.5


@dataclass
class Communicator:
    cpu_group: object
    device_group: object


@dataclass
class Coordinator:
    """vLLM's DP ``GroupCoordinator`` as the close and the rebuild reach it."""

    cpu_group: object
    device_group: object
    device_communicator: Communicator = field(init=False)

    def __post_init__(self) -> None:
        self.device_communicator = Communicator(self.cpu_group, self.device_group)


class OneDpGroup(RealVllmDistributed):
    """vLLM's real group functions, with the DP group given instead of vLLM's global one."""

    def __init__(self, group: Coordinator) -> None:
        self.group = group

    def dp_group(self) -> Any:
        return self.group

    def all2all_manager(self) -> None:
        return None


@dataclass
class Parallel:
    data_parallel_rank: int
    data_parallel_size: int = 2
    world_size: int = 1
    data_parallel_master_ip: str = "127.0.0.1"
    cpu_distributed_timeout_seconds: float = OP_TIMEOUT_S


@dataclass
class Worker:
    parallel_config: Parallel
    rank: int = 0


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


def _raise_holding(group: object) -> None:
    """A failed step whose frame holds the group (as a collective's ``group`` argument)."""
    raise RuntimeError(f"[FT] fault injected while holding {type(group).__name__}")


def _rank(rank: int, ports: list[int], out: Any) -> None:
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group as init

    timeout = timedelta(seconds=OP_TIMEOUT_S)
    cpu = init("127.0.0.1", ports[0], rank, 2, backend="gloo", timeout=timeout)
    device = init("127.0.0.1", ports[1], rank, 2, backend="gloo", timeout=timeout)
    coordinator = Coordinator(cpu, device)
    hooks = VllmWorkerHooks(Worker(Parallel(rank)), OneDpGroup(coordinator))  # type: ignore[arg-type]
    hooks.gloo_device_group = True
    del cpu, device  # the coordinator holds them, as vLLM's does
    ones = torch.ones(4)
    dist.all_reduce(ones, group=_device(coordinator))
    report: dict[str, Any] = {"rank": rank}
    if rank == 1:
        time.sleep(CLOSE_AFTER_S)
        try:
            _raise_holding(_device(coordinator))
        except RuntimeError as exc:  # what WorkerFaultAdapter.report_exception does
            traceback.clear_frames(exc.__traceback__)
            hooks.close_dp_group()
        report["closed_at"] = time.time()
    else:
        gathered = torch.empty(8)
        started = time.monotonic()
        try:
            dist.all_gather_into_tensor(gathered, ones, group=_device(coordinator))
        except RuntimeError as exc:
            report["failed_at"] = time.time()
            report["waited_s"] = time.monotonic() - started
            report["error"] = str(exc).splitlines()[0]
            report["kind"] = classify_exception(exc).value
            traceback.clear_frames(exc.__traceback__)
            hooks.close_dp_group()  # the peer faults in turn (its quarantine)
    report["stand_in_raises"] = _raises(coordinator)
    # The retry: every rank rebuilds on fresh ports, then a collective works again.
    hooks.publish_dp_ports([ports[2]])
    hooks.rebuild_dp_group(frozenset({0, 1}), epoch=1)
    total = torch.full((2,), float(rank + 1))
    dist.all_reduce(total, group=_device(coordinator))
    report["after_retry"] = total.tolist()
    out.put(report)


def _device(coordinator: Coordinator) -> dist.ProcessGroup:
    return cast(dist.ProcessGroup, coordinator.device_group)


def _raises(coordinator: Coordinator) -> bool:
    try:
        dist.all_reduce(torch.zeros(1), group=cast(dist.ProcessGroup, coordinator.cpu_group))
    except RuntimeError:
        return True
    return False


def test_a_closed_dp_group_releases_the_peers_wait_at_once_and_the_retry_rebuilds_it() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = _free_ports(3)
    procs = [ctx.Process(target=_rank, args=(r, ports, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got: list[dict[str, Any]] = [out.get(timeout=240) for _ in procs]
        reports = {int(r["rank"]): r for r in got}
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    survivor, faulted = reports[0], reports[1]
    # "Connection closed by peer" (or reset, had it not been waiting yet): a peer's fault
    assert survivor["kind"] == FaultKind.DEAD_PEER.value, reports
    # Released as the peer closed, far from the 30 s op timeout.
    late = float(survivor["failed_at"]) - float(faulted["closed_at"])
    assert late < 1.0 and float(survivor["waited_s"]) < OP_TIMEOUT_S / 3, (late, reports)
    assert survivor["stand_in_raises"] and faulted["stand_in_raises"], reports
    assert survivor["after_retry"] == faulted["after_retry"] == [3.0, 3.0], reports
