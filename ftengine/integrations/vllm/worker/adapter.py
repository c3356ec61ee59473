"""ftengine's one adapter in a vLLM worker: it stands where vLLM builds its own
``WorkerSentinel(worker=self)`` and takes vLLM's fault-tolerance calls to ftengine's.

The fault path through it, read top to bottom: a model step raises (the step wrappers,
``step_wrappers.py``) -> :meth:`WorkerFaultAdapter.report_exception` -> ftengine's
``RankSentinel.report_fault`` -> its ``RecoveryEngine`` (which drives the worker's
``VllmHostedBackend``). A command from vLLM's engine core arrives as vLLM's
``Worker.handle_ft_command`` -> :meth:`WorkerFaultAdapter.handle_command` ->
``commands.VllmCommands.run`` -> ``RankSentinel.run_command``.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ftengine.errors import FTEngineError
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.shapes import WorkerLike
from ftengine.integrations.vllm.status_file import StatusFile, file_fields
from ftengine.integrations.vllm.worker.factory import (
    BackendFactory,
    SentinelSeams,
    WorkerFt,
    backend_for_platform,
    build_worker_ft,
    current_device_type,
)
from ftengine.integrations.vllm.worker.step_wrappers import wrap_worker

if TYPE_CHECKING:
    from typing import Unpack  # 3.11+; annotations are never evaluated at run time

CONFIG_MODULE = "vllm.config"
ENGINE_CORE_FAULT = "fault seen by vLLM's engine core"


class CommandFailed(FTEngineError, RuntimeError):
    """A command reached this worker and failed; ``result`` is its ``FaultToleranceResult``.

    Raised from :meth:`WorkerFaultAdapter.handle_command` only: vLLM 0.33.0's engine core
    ignores what ``collective_rpc`` returns and sees a worker's failure only as an
    exception (it then answers ``success=False``).
    """

    def __init__(self, reason: str, result: object) -> None:
        super().__init__(reason)
        self.result = result


class WorkerFaultAdapter:
    """ftengine in one vLLM worker, where vLLM builds ``WorkerSentinel(worker)``.

    At construction (vLLM start-up, before the device and the model exist) it checks
    ftengine's settings and the platform, so a bad flag or an unsupported platform stops
    vLLM at once. ftengine's pieces (``ft``: sentinel, engine, backend) are built by
    :meth:`attach` after ``load_model``. ``seams`` (see ``factory.build_worker_ft``) are
    for tests and for vLLM-Ascend's subclass; vLLM passes only ``worker``.
    """

    def __init__(self, worker: WorkerLike, **seams: Unpack[SentinelSeams]) -> None:
        self.worker = worker
        self.settings = VllmFtSettings.from_vllm_config(worker.vllm_config)
        if seams.get("backend_factory") is None:
            seams["backend_factory"] = self._platform_backend()
        self._build: Callable[[], WorkerFt] = functools.partial(
            build_worker_ft, worker, settings=self.settings, **seams
        )
        self.ft: WorkerFt | None = None
        self._status_sink: Callable[[dict[str, object]], None] | None = None
        wrap_worker(worker, self)

    def _platform_backend(self) -> BackendFactory:
        """vLLM's platform's backend (or ``UnsupportedPlatform``)."""
        return backend_for_platform(current_device_type())

    def attach(self) -> WorkerFt:
        """Build ftengine's pieces (once; the model and its EPLB maps must be loaded); from
        then on every phase change is written to the engine core's status file."""
        if self.ft is None:
            self.ft = self._build()
            self.ft.sentinel.subscribe(lambda _change: self.publish_status())
            status = StatusFile.for_worker(self.worker.parallel_config.data_parallel_rank)
            if status is not None:
                # The worker's redundancy facts go with it: the engine core's policy reads them.
                facts = self.ft.sentinel.engine.redundancy
                self._status_sink = lambda fields: status.write(file_fields(fields, facts))
            self.publish_status()
        return self.ft

    def publish_status(self) -> None:
        """Write the current status to the engine core's status file (if there is one)."""
        if self.ft is not None and self._status_sink is not None:
            self._status_sink(self.ft.sentinel.status().to_dict())

    def serving_started(self) -> None:
        """After ``compile_or_warm_up_model``: the worker serves from now on; apply what
        start-up must run without (op timeouts)."""
        ft = self.attach()
        if ft.serving_op_timeout_s is not None:
            ft.sentinel.backend.set_op_timeout(ft.serving_op_timeout_s)
        if ft.sentinel.engine.phase is Phase.LOADING:
            ft.sentinel.loaded()  # a restarted rank: warmed up, it waits to be admitted
        self.publish_status()

    def report_exception(self, exc: BaseException) -> None:
        """Report an exception from a model step (ignored before the model is loaded).

        The step's finished frames let go of their locals first: one may hold a process
        group (a collective's ``group`` argument), which the quarantine closes so that the
        peers waiting in it fail at once; a reference from the traceback would keep it open.
        The traceback itself (files, lines) is kept for vLLM's log."""
        if self.ft is not None:
            chained: BaseException | None = exc
            seen: set[int] = set()
            while chained is not None and id(chained) not in seen:  # and what it wraps
                seen.add(id(chained))
                traceback.clear_frames(chained.__traceback__)
                chained = chained.__cause__ or chained.__context__
            self.ft.sentinel.report_fault(exc)

    def adopt_engine_fault(self, kind: FaultKind) -> None:
        """The engine core faulted (e.g. a peer died while this worker idled): a worker
        still serving quarantines now, so its phase agrees with vLLM's status. Ignored
        before the model is loaded."""
        if self.ft is not None and self.ft.sentinel.serving:
            sentinel = self.ft.sentinel
            sentinel.report(Fault(kind=kind, info=ENGINE_CORE_FAULT, at=sentinel.clock.now()))

    def handle_command(self, ft_request: object) -> Any:
        """Overrides vLLM's ``WorkerSentinel.handle_command`` (vLLM's name, kept: vLLM's
        ``Worker.handle_ft_command`` calls it after the engine core found itself
        UNHEALTHY), inside ``set_current_vllm_config`` (the dummy batch runs the model).

        A worker still serving adopts that fault first (the engine core saw it, e.g. in
        its DP all-reduce, before any model step here did). Returns the
        ``FaultToleranceResult``; raises :class:`CommandFailed` carrying it on failure.
        A command before ``load_model`` finished builds ftengine's pieces now (the model
        runner raises if the maps do not exist; vLLM reports that as the command's
        failure)."""
        with _current_config(self.worker):
            ft = self.attach()
            command = ft.commands.messages.split(ft_request)
            scale_down = command.instruction == "scale_down"
            if command.instruction != "scale_up":  # an admission is no fault: it serves on
                self.adopt_engine_fault(FaultKind.DEAD_PEER if scale_down else FaultKind.TRANSIENT)
            result = ft.commands.run(ft_request)
            if not result.success:
                raise CommandFailed(str(result.reason), result)
            return result


def adopt_fault(wrapper: Any, kind: str) -> None:
    """Runs in the worker, sent by the engine core's agent (``collective_rpc``): the
    worker's FSM adopts the engine core's fault."""
    worker = getattr(wrapper, "worker", wrapper)
    adapter = getattr(worker, "worker_sentinel", None)  # vLLM's attribute name
    adopt = getattr(adapter, "adopt_engine_fault", None)  # vLLM's own sentinel has none
    if callable(adopt):
        adopt(FaultKind(kind))


def worker_phase(wrapper: Any) -> str | None:
    """Runs in the worker, asked by the engine core (``collective_rpc``): its FSM's phase
    (``quarantined``, ``healthy``, ``dead``, ...), or None before ftengine's pieces exist."""
    worker = getattr(wrapper, "worker", wrapper)
    ft = getattr(getattr(worker, "worker_sentinel", None), "ft", None)
    return None if ft is None else str(ft.commands.status()["phase"])


@contextlib.contextmanager
def _current_config(worker: WorkerLike) -> Iterator[None]:
    """vLLM's ``set_current_vllm_config(worker.vllm_config)``, as vLLM's own sentinel does."""
    with import_vllm(CONFIG_MODULE).set_current_vllm_config(worker.vllm_config):
        yield
