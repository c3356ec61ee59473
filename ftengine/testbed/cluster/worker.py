"""One CPU cluster worker process: loads its slots, joins the EP group, serves lockstep steps
and recovers through a RankSentinel.

The main thread does everything that touches the engine or the process group (steps,
commands, peer faults, ``poll``), so the engine never sees two threads at once; a
daemon thread only sends heartbeats, so a hung main thread still beats but a stopped
process does not. The worker dies with its supervisor (PR_SET_PDEATHSIG and pipe EOF).
With fault tolerance off (``ClusterConfig.fault_tolerance``) there is no heartbeat thread,
no engine polling and no status after steps, and a step error ends the process.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import attrs
import torch
from torch._C._distributed_c10d import TCPStore

from ftengine.commands import CommandResult
from ftengine.context import RedundancyFacts
from ftengine.errors import ConfigError
from ftengine.sentinel import HostedBackend, RankSentinel
from ftengine.status import PhaseChange
from ftengine.testbed.cluster.adapters import build_command_adapter
from ftengine.testbed.cluster.config import ClusterConfig
from ftengine.testbed.cluster.faults_inject import (
    FaultInjector,
    FaultSpec,
    InjectedFault,
    InjectKind,
)
from ftengine.testbed.cluster.model import DenseWeights, ModelConfig, RequestState, forward_step
from ftengine.testbed.cluster.netns import enter as enter_netns
from ftengine.testbed.cluster.netns import network_beat
from ftengine.testbed.cluster.policies import build_policy
from ftengine.testbed.cluster.protocol import (
    FtCommand,
    FtReply,
    Heartbeat,
    Inject,
    ItemRejected,
    Link,
    PeerFault,
    PhaseEvent,
    RankReady,
    Ready,
    Shutdown,
    StatusUpdate,
    StepItem,
    StepOutput,
    StepReply,
    StepRequest,
    WorkerFailed,
)
from ftengine.testbed.cpu.backend import CpuBackend
from ftengine.testbed.cpu.experts import CpuExperts
from ftengine.testbed.model_limits import ModelLimits
from ftengine.weights.index import CheckpointIndex

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often the main loop lets the engine run time-driven decisions
DUMMY_TOKEN = 0


def _resolved(
    instance: object, attribute: attrs.Attribute[ClusterConfig], value: ClusterConfig
) -> None:
    if value.num_redundant_experts is None:
        raise ConfigError(
            "WorkerSpec.config.num_redundant_experts must be resolved to a count of EPLB "
            "slots (WorkerSpec.from_config does it), found None"
        )


@attrs.frozen
class WorkerSpec:
    """Everything one worker process needs (picklable; sent by the supervisor at spawn).

    The worker reads the cluster's whole ``config`` (so a new ClusterConfig field reaches
    the workers without being copied by hand), as the supervisor resolved it: the EPLB
    slot count is known and ``inject_fault`` comes from ``FTENGINE_INJECT_FAULT`` when the
    config sets none. Timeouts derived from the config are read through its properties.
    """

    config: ClusterConfig = attrs.field(validator=_resolved)
    rank: int
    store_port: int
    rejoining: bool = False  # a removed rank restarted: load, report ready, wait to be admitted

    @classmethod
    def from_config(
        cls,
        config: ClusterConfig,
        rank: int,
        *,
        store_port: int,
        num_redundant: int,
        inject_fault: FaultSpec | None,
        rejoining: bool = False,
    ) -> WorkerSpec:
        """Rank ``rank``'s spec under ``config`` (the store listens on ``store_port``), with
        ``num_redundant`` EPLB slots and ``inject_fault`` resolved by the supervisor;
        ``rejoining`` for a removed rank restarted to come back."""
        resolved = attrs.evolve(
            config, num_redundant_experts=num_redundant, inject_fault=inject_fault
        )
        return cls(resolved, rank, store_port, rejoining)

    @property
    def world_size(self) -> int:
        """DP = EP size of the cluster."""
        return self.config.dp_size

    @property
    def num_redundant(self) -> int:
        """Redundant EPLB slots (never None here: validated at construction)."""
        return self.config.num_redundant_experts or 0


def _cpu_backend(spec: WorkerSpec, index: CheckpointIndex, injector: FaultInjector) -> CpuBackend:
    """Load this rank's expert slots and wrap them in a CPU backend over the shared store."""
    experts = CpuExperts.load(
        index, rank=spec.rank, world=spec.world_size, num_redundant=spec.num_redundant
    )
    store = TCPStore(
        spec.config.host,
        spec.store_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=spec.config.rendezvous_timeout_s),
    )
    return CpuBackend(
        rank=spec.rank,
        world_size=spec.world_size,
        store=store,
        experts=experts,
        op_timeout_s=spec.config.worker_op_timeout_s,
        rendezvous_timeout_s=spec.config.rendezvous_timeout_s,
        reload_fails=injector.reload_due,
        grown=spec.config.rejoin_grown,
    )


class ClusterWorker:
    """The host worker of one DP rank; implements ``WorkerHooks`` for its sentinel."""

    def __init__(self, spec: WorkerSpec, link: Link) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.link = link
        self.injector = FaultInjector(spec.config.inject_fault, spec.rank)
        index = CheckpointIndex.open(spec.config.checkpoint)
        self.cfg = ModelConfig.from_hf(index.config)
        self.limits = ModelLimits.from_config(index.config)
        self.dense = DenseWeights.load(index.read, self.cfg)
        self.backend = _cpu_backend(spec, index, self.injector)
        self.requests: dict[str, RequestState] = {}
        self.sentinel = self._sentinel()
        self.commands = build_command_adapter(spec.config.command_adapter, self.sentinel, spec.rank)
        self._last_status: dict[str, Any] | None = None
        # A command runs in its own thread, so that a peer's fault reaching this worker
        # while a recovery step blocks (a group rendezvous waiting for a peer that died
        # meanwhile) interrupts the recovery at once instead of after the step's timeout;
        # every other message waits for the command to end, in order.
        self._command: tuple[threading.Thread, FtCommand, list[CommandResult]] | None = None
        self._held: list[object] = []
        if spec.rejoining:
            # Loaded its own slots above, alone: it joins the survivors' groups only when
            # admitted (scale_up); until then it serves nothing.
            self.sentinel.loaded()
        else:
            self.backend.rebuild_groups(frozenset(range(spec.world_size)), 0)

    def _sentinel(self) -> RankSentinel:
        spec, experts = self.spec, self.backend.experts
        sentinel = RankSentinel(
            build_policy(spec.config.policy, spec.config.recovery_timeout_s),
            HostedBackend(self.backend, self),
            rank=spec.rank,
            world_size=spec.world_size,
            redundancy=RedundancyFacts(
                ep_size=spec.world_size,
                local_slots=experts.local_slots,
                num_logical=experts.placement.num_logical,
            ),
            rejoining=spec.rejoining,
        )
        sentinel.subscribe(self._on_phase)
        return sentinel

    # -- WorkerHooks ----------------------------------------------------------------------
    def clean_state(self) -> None:
        if self.spec.config.reinference_bounds is None:
            self.requests.clear()
            return
        # Re-inference: the host memory survived the fault, so the caches of finished
        # steps are kept for the held requests; only what the faulted step wrote goes.
        for request_id in list(self.requests):
            self._roll_back(request_id)

    def run_dummy_batch(self) -> None:
        self.backend.dp_sync(1, -1)
        forward_step(
            self.cfg, self.dense, [(RequestState("dummy"), [DUMMY_TOKEN])], self.backend.moe
        )

    def expert_layers(self) -> tuple[object, ...]:
        return self.backend.experts.layers()

    # -- main loop --------------------------------------------------------------------------
    def serve(self) -> None:
        """Handle supervisor messages until Shutdown or the pipe closes."""
        conn, ft = self.link.conn, self.spec.config.fault_tolerance
        while True:
            # FT off: nothing is time-driven, so block until the next message.
            if conn.poll(POLL_S if ft else None):
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    return
                if isinstance(message, Shutdown):
                    return
                if self._command is None:
                    self._handle(message)
                elif isinstance(message, PeerFault):
                    self._handle(message)  # interrupts the running recovery
                else:
                    self._held.append(message)
            if self._command is not None:
                self._finish_command()
            if ft and self._command is None:
                self.sentinel.poll()
            if ft:
                self.publish_status()

    def _handle(self, message: object) -> None:
        if isinstance(message, StepRequest):
            reply = self._step(message)
            if self.spec.config.fault_tolerance:
                self.publish_status()
            self.link.send(reply)
        elif isinstance(message, FtCommand):
            results: list[CommandResult] = []
            thread = threading.Thread(
                target=lambda: results.append(
                    self.commands.run_command(
                        message.instruction, message.params, message.request_id
                    )
                ),
                name=f"ftengine-command-{message.request_id}",
                daemon=True,
            )
            self._command = (thread, message, results)
            thread.start()
        elif isinstance(message, PeerFault):
            # A late notice about a rank this worker already scaled away is old news.
            if message.rank != self.rank and message.rank not in self.backend.dead:
                self.sentinel.peer_fault(message.kind, message.rank, message.info)
        elif isinstance(message, RankReady):
            # At a step boundary (the supervisor holds its steps): the policy may admit them.
            self.sentinel.note_ready(frozenset(message.ranks))
            self.sentinel.poll()
            self.publish_status()
            status = self.sentinel.status()
            ok = status.phase.member
            why = None if ok else f"phase {status.phase.value}: {status.ft_error}"
            self.link.send(FtReply(self.rank, message.request_id, ok, why))
        elif isinstance(message, Inject):
            self.injector.arm(message.spec)
        else:
            logger.error("unknown message %r", message, extra={"rank": self.rank})

    def _finish_command(self) -> None:
        """Once the running command's thread ended: its status, its reply, then the
        messages held meanwhile, in order."""
        assert self._command is not None
        thread, message, results = self._command
        if thread.is_alive():
            return
        self._command = None
        if results:
            result = results[0]
            self.publish_status()
            self.link.send(FtReply(self.rank, result.request_id, result.success, result.reason))
        else:  # the command raised: the thread's traceback is in the log
            why = f"command {message.instruction} raised in engine {self.rank}"
            self.link.send(FtReply(self.rank, message.request_id, False, why))
        held, self._held = self._held, []
        for index, later in enumerate(held):
            if self._command is not None:  # a held command started: the rest wait again
                self._held = held[index:] + self._held
                return
            self._handle(later)

    def _step(self, request: StepRequest) -> StepReply:
        for request_id in request.release:
            self.requests.pop(request_id, None)
        ft = self.spec.config.fault_tolerance
        if ft and not self.sentinel.serving:
            return StepReply(
                self.rank,
                request.step,
                error=f"engine {self.rank} is {self.sentinel.phase.value}, not serving",
                error_type="NotServing",
            )
        admitted, rejected = self._admit(request.items)
        try:
            logits = self._forward(request.step, admitted)
        except Exception as exc:
            for item in admitted:  # the faulted step's KV is not to be trusted
                self._roll_back(item.request_id)
            reply = StepReply(
                self.rank, request.step, error=str(exc), error_type=type(exc).__name__
            )
            if not ft:
                # No fault tolerance: the error ends this worker, as it ends vLLM's engine core.
                self.link.send(reply)
                raise
            self.sentinel.report_fault(exc, step=request.step)
            return reply
        outputs = tuple(
            StepOutput(
                item.request_id,
                int(torch.argmax(row)),
                tuple(row.tolist()) if item.want_logits else None,
            )
            for item, row in zip(admitted, logits, strict=True)
        )
        return StepReply(self.rank, request.step, outputs, rejected=rejected)

    def _admit(self, items: Sequence[StepItem]) -> tuple[list[StepItem], tuple[ItemRejected, ...]]:
        """Split a step's items into those this rank can compute and those it cannot: a bad
        request fails alone (its cache dropped) and the step still runs for the others, so
        one request can never make the engines unhealthy."""
        admitted, rejected = [], []
        for item in items:
            state = self.requests.get(item.request_id)
            cached = 0 if state is None else state.num_tokens
            if item.start is not None and item.start != cached:
                self.requests.pop(item.request_id, None)
                why = (
                    f"its KV cache holds {cached} tokens on rank {self.rank}, {item.start} expected"
                )
                rejected.append(ItemRejected(item.request_id, why, cache_lost=True))
                continue
            problem = self.limits.item_problem(cached, item.token_ids)
            if problem is None:
                admitted.append(item)
            else:
                self.requests.pop(item.request_id, None)
                rejected.append(ItemRejected(item.request_id, problem))
        return admitted, tuple(rejected)

    def _roll_back(self, request_id: str) -> None:
        """Cut a request's cache back to the tokens its finished steps wrote (a failed step
        may have appended K/V in some layers before it raised)."""
        state = self.requests.get(request_id)
        if state is None:
            return
        if state.num_tokens == 0:
            del self.requests[request_id]
            return
        n = state.num_tokens
        state.cache = [(k[:n], v[:n]) for k, v in state.cache]

    def _forward(self, step: int, items: Sequence[StepItem]) -> list[torch.Tensor]:
        """DP sync and one model step of ``items``: each one's last-token logits [V]."""
        self._inject(step)
        if self.injector.poisoned(t for item in items for t in item.token_ids):
            raise InjectedFault(f"injected poison token on rank {self.rank} at step {step}")
        self.backend.dp_sync(sum(len(i.token_ids) for i in items), step)
        batch = [
            (self.requests.setdefault(i.request_id, RequestState(i.request_id)), i.token_ids)
            for i in items
        ]
        return forward_step(self.cfg, self.dense, batch, self.backend.moe)

    def _inject(self, step: int) -> None:
        kind = self.injector.due(step)
        if kind is InjectKind.RAISE:
            raise InjectedFault(f"injected fault on rank {self.rank} at step {step}")
        if kind is InjectKind.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        if kind is InjectKind.HANG:
            logger.warning("injected hang", extra={"rank": self.rank, "step": step})
            while True:  # the heartbeat thread keeps beating: only the op timeout sees this
                time.sleep(3600)

    def _on_phase(self, change: PhaseChange) -> None:
        self.link.send(
            PhaseEvent(self.rank, change.source.value, change.dest.value, change.at, change.reason)
        )

    def publish_status(self) -> None:
        """Send the engine's status to the supervisor if it changed since the last send."""
        status = self.sentinel.status().to_dict()
        if status != self._last_status:
            self._last_status = status
            self.link.send(StatusUpdate(self.rank, status))


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the supervisor dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        logger.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on pipe EOF")


def _heartbeats(
    link: Link, rank: int, every_s: float, stop: threading.Event, reachable: Callable[[], bool]
) -> None:
    while not stop.wait(every_s):
        if not reachable():
            continue  # cut off the network: silence, so the supervisor fences this rank
        try:
            link.send(Heartbeat(rank, time.monotonic()))
        except (OSError, ValueError):
            os._exit(0)  # the supervisor is gone


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Process entry point (multiprocessing spawn target)."""
    _die_with_parent()
    config = spec.config
    if config.worker_netns is not None:
        enter_netns(config.worker_netns[spec.rank])  # first: every socket after is inside
    torch.set_num_threads(spec.config.torch_threads)
    logging.basicConfig(level=os.environ.get("FTENGINE_WORKER_LOG", "WARNING"))
    link = Link(conn)
    try:
        worker = ClusterWorker(spec, link)
    except Exception:
        link.send(WorkerFailed(spec.rank, traceback.format_exc()))
        return
    worker.publish_status()
    link.send(Ready(spec.rank, os.getpid()))
    stop = threading.Event()
    if spec.config.fault_tolerance:
        reachable = (
            (lambda: True)
            if config.worker_netns is None
            else network_beat(
                config.host, spec.store_port, spec.rank, config.heartbeat_timeout_s / 2
            )
        )
        beats = (link, spec.rank, config.heartbeat_s, stop, reachable)
        threading.Thread(target=_heartbeats, args=beats, daemon=True).start()
    try:
        worker.serve()
    except Exception:
        link.send(WorkerFailed(spec.rank, traceback.format_exc()))
    finally:
        stop.set()
