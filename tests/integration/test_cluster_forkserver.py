"""Workers started from a fork server (``ClusterConfig.worker_start="forkserver"``, what the
chaos campaign relaunches with) behave as spawned ones: the reference tokens, a SIGKILL
seen and scaled down past, and a relaunch that costs no imports."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from ftengine.testbed.cluster import Generation, starts
from ftengine.testbed.cluster.starts import forked_worker_main, worker_context, worker_target
from ftengine.testbed.cluster.worker import worker_main
from tests.integration.conftest import Launcher
from tests.integration.test_cluster_e2e import assert_matches, kill_and_scale_down

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_forked_workers_serve_scale_down_and_relaunch_fast(
    launch: Launcher, reference: list[Generation]
) -> None:
    first = launch(worker_start="forkserver")
    parents = {psutil.Process(pid).ppid() for pid in first.pids().values() if pid is not None}
    assert len(parents) == 1 and os.getpid() not in parents, f"forked by one server: {parents}"
    assert_matches(first, reference)
    kill_and_scale_down(first, 3, reference, [3], "forkserver kill rank 3")
    first.shutdown()
    began = time.monotonic()
    again = launch(worker_start="forkserver")
    relaunch = time.monotonic() - began
    assert_matches(again, reference)
    # A spawned DP=4 launch imports torch four times: 20-35 s on this loaded machine.
    assert relaunch < 10.0, f"a forked relaunch took {relaunch:.1f} s"


@pytest.fixture
def saved_environ() -> Iterator[None]:
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_a_forked_worker_runs_under_the_supervisors_environment_of_the_moment(
    saved_environ: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, str]] = []

    def fake_worker_main(spec: Any, conn: Any) -> None:
        seen.append(dict(os.environ))

    monkeypatch.setattr(starts, "worker_main", fake_worker_main)
    os.environ["FTENGINE_LEFT_OVER_FROM_THE_SERVER"] = "1"
    forked_worker_main({"FTENGINE_WORKER_LOG": "DEBUG"}, None, None)  # type: ignore[arg-type]
    assert seen == [{"FTENGINE_WORKER_LOG": "DEBUG"}]


def test_each_start_method_gets_its_context_and_target() -> None:
    assert worker_context("spawn").get_start_method() == "spawn"
    assert worker_context("forkserver").get_start_method() == "forkserver"
    spec: Any = object()
    conn: Any = object()
    assert worker_target("spawn", spec, conn) == (worker_main, (spec, conn))
    target, args = worker_target("forkserver", spec, conn)
    assert target is forked_worker_main and args == (dict(os.environ), spec, conn)
