"""Shared set-up of the CPU backend's unit tests: a tiny checkpoint, a one-rank gloo world
(store + backend), and several gloo ranks as threads of the test process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from torch._C._distributed_c10d import TCPStore

from ftengine.testbed.cpu.backend import CpuBackend
from ftengine.testbed.cpu.comm import GlooGroup
from ftengine.testbed.cpu.experts import CpuExperts
from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.index import CheckpointIndex

T = TypeVar("T")


def tiny_checkpoint(path: Path) -> Path:
    """A 2-layer, 4-expert, hidden-16 checkpoint at ``path`` (vocab 32): seconds to build."""
    return make_checkpoint(
        path,
        layers=2,
        experts=4,
        hidden=16,
        intermediate=8,
        vocab=32,
        heads=2,
        kv_heads=1,
    )


def one_rank_store() -> TCPStore:
    """A fresh rendezvous store on a free loopback port, served by this process."""
    return TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)


def one_rank_backend(checkpoint: Path, store: TCPStore) -> CpuBackend:
    """The CPU backend of rank 0 in a world of one, joined to its epoch-0 group."""
    index = CheckpointIndex.open(checkpoint)
    experts = CpuExperts.load(index, rank=0, world=1, num_redundant=4)
    backend = CpuBackend(
        rank=0,
        world_size=1,
        store=store,
        experts=experts,
        op_timeout_s=5.0,
        rendezvous_timeout_s=5.0,
    )
    backend.rebuild_groups(frozenset({0}), 0)
    return backend


def on_ranks(world: int, fn: Callable[[GlooGroup], T]) -> list[T]:
    """Run ``fn(group)`` on ``world`` ranks (threads of this process, one gloo group)."""
    store = one_rank_store()
    results: list[T | None] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            # A TCPStore client is not thread-safe: each rank gets its own, as processes do.
            client = TCPStore("127.0.0.1", store.port, is_master=False)
            group = GlooGroup(
                client, frozenset(range(world)), rank, 0, op_timeout_s=10, rendezvous_timeout_s=10
            )
            results[rank] = fn(group)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return [r for r in results if r is not None]
