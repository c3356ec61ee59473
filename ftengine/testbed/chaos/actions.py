"""What each fault kind does to a running deployment: signals to the cluster's own worker
pids, faults armed inside a worker (``Cluster.inject``), and weight shards broken on disk
around a reload (kept aside and put back by :meth:`Injected.repair`)."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ftengine.errors import ConfigError
from ftengine.testbed.chaos.catalogue import ChaosKind, Injected, PlannedFault
from ftengine.testbed.chaos.deployment import Deployment
from ftengine.testbed.cluster import FaultSpec, InjectKind
from ftengine.testbed.cluster.netns import Hosts


def _shards(checkpoint: Path) -> list[Path]:
    return sorted(checkpoint.glob("model-*.safetensors")) or sorted(
        checkpoint.glob("*.safetensors")
    )


def break_shards(checkpoint: Path, kind: ChaosKind, stash: Path) -> Callable[[], None]:
    """Truncate (to half) or remove every weight shard of ``checkpoint``, keeping the
    originals in ``stash``; returns what puts them back."""
    stash.mkdir(parents=True, exist_ok=True)
    # A directory of its own: a second shard fault during this one's recovery must not
    # overwrite the originals kept here with its broken copies.
    stash = Path(tempfile.mkdtemp(prefix="shards-", dir=stash))
    kept = []
    for shard in _shards(checkpoint):
        backup = stash / shard.name
        shutil.copy2(shard, backup)
        kept.append((shard, backup))
        if kind is ChaosKind.SHARD_REMOVED:
            shard.unlink()
        else:
            os.truncate(shard, shard.stat().st_size // 2)

    def restore() -> None:
        for shard, backup in kept:
            os.replace(backup, shard)  # atomic: a reader sees the whole file or none

    return restore


def inject(
    deployment: Deployment,
    fault: PlannedFault,
    live: Sequence[int],
    stash: Path,
    hosts: Hosts | None = None,
) -> Injected:
    """Inject ``fault`` on victims chosen among ``live`` (the serving, unremoved ranks)."""
    cluster = deployment.cluster
    kind = fault.kind
    victims = fault.victims(live)
    survivors = tuple(r for r in sorted(live) if r not in victims)
    detectors = tuple(sorted(live)) if kind is ChaosKind.STEP_RAISE else survivors
    engines = {e["id"]: e for e in cluster.status()["engines"]}
    episodes = {r: int(engines[r].get("fault_episodes") or 0) for r in detectors}
    injected = Injected(
        fault, time.monotonic(), victims, detectors, cluster.steps_run, episodes=episodes
    )
    if kind is ChaosKind.NET_CUT:
        if hosts is None:
            raise ConfigError("a net_cut fault needs the cluster's workers in network namespaces")
        for rank in victims:
            hosts.cut(rank)
            injected.repairs.append(functools.partial(hosts.heal, rank))
        return injected
    if kind is ChaosKind.STEP_RAISE:
        cluster.inject(FaultSpec(rank=victims[0], kind=InjectKind.RAISE, step=0))
        return injected
    if kind is ChaosKind.RELOAD_ERROR and survivors:
        cluster.inject(
            FaultSpec(rank=survivors[fault.pick % len(survivors)], kind=InjectKind.RELOAD_ERROR)
        )
    if kind in (ChaosKind.SHARD_TRUNCATED, ChaosKind.SHARD_REMOVED):
        injected.repairs.append(break_shards(cluster.config.checkpoint, kind, stash))
    sig = signal.SIGSTOP if kind is ChaosKind.SIGSTOP else signal.SIGKILL
    injected.at = time.monotonic()
    for rank in victims:
        cluster.kill(rank, sig)
    return injected
