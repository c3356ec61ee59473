"""The vLLM general plugin: with ``--enable-fault-tolerance`` every worker runs ftengine.

vLLM loads ``ftengine.integrations.vllm.plugin:register`` (entry point group
``vllm.general_plugins``) in each of its processes before the worker class is imported.
``register`` puts :func:`worker_sentinel` where vLLM's GPU worker (and its CPU subclass)
builds its ``WorkerSentinel(worker=self)``, which vLLM does only when fault tolerance is
on: on vLLM's CPU platform that is a :class:`PluginWorkerSentinel`, elsewhere vLLM's own
sentinel (one warning). On vLLM-Ascend (platform "npu") it leaves vLLM's GPU modules alone:
vLLM-Ascend's ``NPUWorker`` is no GPU ``Worker`` and builds a sentinel of its own, which
ftengine's second entry point (``ftengine.integrations.vllm_ascend.plugin:register``) takes
over. It also installs
the engine-core agent and, on CPU, the DP+EP pieces vLLM lacks (``patches``), and routes
ftengine's logs through vLLM's logging with the ``[FT]`` prefix.
vLLM has no hook for "model loaded", "warmed up" or "model step failed", so the sentinel
wraps the worker's ``load_model`` (build the engine once the model exists),
``compile_or_warm_up_model`` (op timeouts from then on) and ``execute_model`` (report the
exception, then re-raise it for vLLM's own fault path).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ftengine.faults import FaultKind
from ftengine.integrations.vllm.api_server.metrics import register_collector
from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.engine_core.agent import file_fields
from ftengine.integrations.vllm.logs import route_logs
from ftengine.integrations.vllm.messages import VllmUnavailable, import_vllm
from ftengine.integrations.vllm.patches.engine_core import (
    VllmSeamMoved,
    apply_cpu_patches,
    apply_engine_core_patches,
)
from ftengine.integrations.vllm.shapes import WorkerLike
from ftengine.integrations.vllm.status_file import StatusFile
from ftengine.integrations.vllm.worker.adapter import FtengineWorkerSentinel
from ftengine.integrations.vllm.worker.factory import (
    CPU,
    NPU,
    SUPPORTED_PLATFORMS,
    BackendFactory,
    SentinelSeams,
    backend_for_platform,
    build_worker_sentinel,
    current_device_type,
)

if TYPE_CHECKING:
    from typing import Unpack  # 3.11+; annotations are never evaluated at run time

logger = logging.getLogger(__name__)

SENTINEL_MODULE = "vllm.v1.worker.sentinel.gpu_worker_sentinel"
CONFIG_MODULE = "vllm.config"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
SENTINEL_NAME = "WorkerSentinel"
WRAPPED_STEPS = ("execute_model", "sample_tokens")
WARM_UP = "compile_or_warm_up_model"
FAULT_FILE_ENV = "FTENGINE_VLLM_FAULT_FILE"
"""Tests' fault injection: a file there holding DP rank R makes R's next model step raise
(once: the file is removed); one holding ``token:T`` makes every model step that runs a
request whose prompt holds token id T, once it has emitted a token, raise, on any rank, for
as long as the file exists (a poison request: its first token streams, then its every step
faults, re-runs included)."""
POISON_PREFIX = "token:"

_upstream: dict[str, Any] = {}
_warned: list[str] = []


def register() -> None:
    """Install :func:`worker_sentinel` as vLLM's worker sentinel, the engine-core agent
    and, on vLLM's CPU platform, the DP+EP pieces it lacks (``patches``); idempotent."""
    try:
        modules = [import_vllm(SENTINEL_MODULE)]
    except VllmUnavailable as exc:
        logger.warning("ftengine's vLLM plugin is inactive: %s", exc)
        return
    device_type = current_device_type()
    # On vLLM-Ascend, replacing the GPU sentinel would make vLLM-Ascend's own sentinel, which
    # subclasses it, a half-initialised subclass of ours; vllm_ascend.plugin acts instead.
    if device_type != NPU:
        if WORKER_MODULE in sys.modules:  # imported already: it bound the name at import
            modules.append(sys.modules[WORKER_MODULE])
        original = getattr(modules[0], SENTINEL_NAME)
        if original is not worker_sentinel:
            _upstream[SENTINEL_NAME] = original
        for module in modules:
            setattr(module, SENTINEL_NAME, worker_sentinel)
    route_logs()
    register_collector()  # scraped only where vLLM serves /metrics: its API server
    try:
        if device_type in SUPPORTED_PLATFORMS:
            apply_engine_core_patches()
        if device_type == CPU:
            apply_cpu_patches()
    except VllmSeamMoved as exc:  # never break a deployment by being installed
        logger.error("[FT] ftengine's vLLM patches are off for this vLLM version: %s", exc)


def worker_sentinel(worker: WorkerLike, **seams: Unpack[SentinelSeams]) -> Any:
    """What vLLM's ``Worker.__init__`` builds as ``WorkerSentinel(worker=self)``: ftengine's
    on a platform it supports (or with a test's ``backend_factory``), else vLLM's own."""
    if seams.get("backend_factory") is None:
        device_type = current_device_type()
        if device_type not in SUPPORTED_PLATFORMS:
            if not _warned:
                _warned.append(device_type)
                logger.warning(
                    "[FT] ftengine does not support vLLM platform %r yet (it supports %s): "
                    "vLLM's own worker sentinel runs",
                    device_type,
                    ", ".join(SUPPORTED_PLATFORMS),
                )
            return _upstream[SENTINEL_NAME](worker=worker)
    return PluginWorkerSentinel(worker, **seams)


class PluginWorkerSentinel:
    """Stands where vLLM builds ``WorkerSentinel(worker)``.

    At construction (vLLM start-up, before the device and the model exist) it checks
    ftengine's settings and the platform, so a bad flag or an unsupported platform stops
    vLLM at once. The ftengine sentinel is built by :meth:`attach` after ``load_model``.
    ``seams`` (see ``build_worker_sentinel``) are for tests and for vLLM-Ascend's subclass;
    vLLM passes only ``worker``.
    """

    def __init__(self, worker: WorkerLike, **seams: Unpack[SentinelSeams]) -> None:
        self.worker = worker
        self.settings = VllmFtSettings.from_vllm_config(worker.vllm_config)
        if seams.get("backend_factory") is None:
            seams["backend_factory"] = self._platform_backend()
        self._build: Callable[[], FtengineWorkerSentinel] = functools.partial(
            build_worker_sentinel, worker, settings=self.settings, **seams
        )
        self.ready: FtengineWorkerSentinel | None = None
        _wrap_worker(worker, self)

    def _platform_backend(self) -> BackendFactory:
        """vLLM's platform's backend (or ``UnsupportedPlatform``)."""
        return backend_for_platform(current_device_type())

    def attach(self) -> FtengineWorkerSentinel:
        """Build the ftengine sentinel (once; the model and its EPLB maps must be loaded)."""
        if self.ready is None:
            self.ready = self._build()
            status = StatusFile.for_worker(self.worker.parallel_config.data_parallel_rank)
            if status is not None:
                self.ready.status_sink = lambda fields: status.write(file_fields(fields))
            self.ready.publish_status()
        return self.ready

    def serving_started(self) -> None:
        """After ``compile_or_warm_up_model``: the worker serves from now on."""
        self._attached().serving_started()

    def adopt_engine_fault(self, kind: FaultKind) -> None:
        """The engine core's fault (``engine_agent.adopt_fault``), see the adapter's."""
        if self.ready is not None:
            self.ready.adopt_engine_fault(kind)

    def handle_command(self, ft_request: object) -> Any:
        """vLLM's ``Worker.handle_ft_command`` entry, inside ``set_current_vllm_config`` (the
        dummy batch runs the model); see ``FtengineWorkerSentinel``."""
        with _current_config(self.worker):
            return self._attached().handle_command(ft_request)

    def handle_ft_command(self, ft_request: object) -> Any:
        """``FaultToleranceRequest`` -> ``FaultToleranceResult``; see ``FtengineWorkerSentinel``."""
        with _current_config(self.worker):
            return self._attached().handle_ft_command(ft_request)

    def on_fault(self, exc: BaseException) -> None:
        """Report an exception from a model step (ignored before the model is loaded)."""
        if self.ready is not None:
            self.ready.on_fault(exc)

    def _attached(self) -> FtengineWorkerSentinel:
        # A command before load_model finished: build now (the model runner raises if the
        # maps do not exist, and vLLM's engine core reports that as the command's failure).
        return self.attach()


def _wrap_worker(worker: WorkerLike, sentinel: PluginWorkerSentinel) -> None:
    """Instance-level wrappers: build after ``load_model``; report model-step exceptions."""
    load = getattr(worker, "load_model", None)
    if callable(load):

        @functools.wraps(load)
        def load_then_attach(*args: Any, **kwargs: Any) -> Any:
            out = load(*args, **kwargs)
            sentinel.attach()
            return out

        setattr(worker, "load_model", load_then_attach)  # noqa: B010 - an instance attribute
    warm_up = getattr(worker, WARM_UP, None)
    if callable(warm_up):

        @functools.wraps(warm_up)
        def warm_up_then_serve(*args: Any, **kwargs: Any) -> Any:
            out = warm_up(*args, **kwargs)
            sentinel.serving_started()
            return out

        setattr(worker, WARM_UP, warm_up_then_serve)
    for name in WRAPPED_STEPS:
        step = getattr(worker, name, None)
        if callable(step):
            setattr(worker, name, _reporting(step, sentinel, worker))


def _reporting(
    step: Callable[..., Any], sentinel: PluginWorkerSentinel, worker: WorkerLike
) -> Callable[..., Any]:
    rank = worker.parallel_config.data_parallel_rank
    scheduled = step.__name__ == "execute_model"  # its first argument: the SchedulerOutput

    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            _maybe_inject(rank, worker, args[0] if scheduled and args else None)
            return step(*args, **kwargs)
        except Exception as exc:
            sentinel.on_fault(exc)
            raise

    return run


def _maybe_inject(rank: int, worker: WorkerLike, scheduler_output: Any) -> None:
    """Raise if ``$FTENGINE_VLLM_FAULT_FILE`` exists and names this DP rank (once) or a
    token in the prompt of a request this step runs (tests)."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path or not os.path.exists(path):
        return
    try:
        with open(path) as handle:
            target = handle.read().strip()
        if target.startswith(POISON_PREFIX):
            _maybe_poison(worker, scheduler_output, target, path)
            return
        if target != str(rank):
            return
        os.unlink(path)
    except OSError:
        return  # another step raced us to it
    raise RuntimeError(f"[FT] fault injected on DP rank {rank} ({FAULT_FILE_ENV}={path})")


def _maybe_poison(worker: WorkerLike, scheduler_output: Any, target: str, path: str) -> None:
    """Raise if a request ``scheduler_output`` runs has emitted a token and has the poison
    token in its prompt."""
    try:
        token = int(target.removeprefix(POISON_PREFIX))
    except ValueError as exc:
        raise ValueError(
            f"{FAULT_FILE_ENV}={path}: expected a DP rank or {POISON_PREFIX}<token id>, "
            f"found {target!r}"
        ) from exc
    for request_id, prompt in scheduled_decodes(worker, scheduler_output).items():
        if token in prompt:
            raise RuntimeError(
                f"[FT] fault injected: poison token {token} in the prompt of request "
                f"{request_id} ({FAULT_FILE_ENV}={path})"
            )


def scheduled_decodes(worker: WorkerLike, scheduler_output: Any) -> dict[str, Sequence[int]]:
    """The prompt token ids of each request a vLLM ``SchedulerOutput`` runs that has emitted
    a token already (decoding, or resumed after a fault): vLLM sends those as cached
    requests, with their output counts; their prompts are in the model runner's states."""
    if scheduler_output is None:
        return {}
    cached = scheduler_output.scheduled_cached_reqs
    states = getattr(getattr(worker, "model_runner", None), "requests", {})
    return {
        request_id: getattr(states.get(request_id), "prompt_token_ids", None) or ()
        for request_id, emitted in zip(cached.req_ids, cached.num_output_tokens, strict=True)
        if emitted > 0
    }


@contextlib.contextmanager
def _current_config(worker: WorkerLike) -> Iterator[None]:
    """vLLM's ``set_current_vllm_config(worker.vllm_config)``, as vLLM's own sentinel does."""
    with import_vllm(CONFIG_MODULE).set_current_vllm_config(worker.vllm_config):
        yield
