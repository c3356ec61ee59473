"""The status files through which a vLLM worker's FSM shows its phase, epoch and removed
ranks to its engine core and API server (same host), and the worker its redundancy facts
(what its expert placement can lose) to the engine core's policy: one per engine core,
named by the engine core's pid, written only under a real vLLM engine core and removed once
that engine core no longer runs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import attrs
import psutil

from ftengine.context import RedundancyFacts
from ftengine.errors import ConfigError

ENGINE_CORE_TITLE = "VLLM::EngineCore"
"""How vLLM titles an engine-core process (setproctitle); its workers are "VLLM::Worker"."""
STATUS_NAME = re.compile(r"ftengine-status-(?P<pid>\d+)-(?P<rank>\d+)\.(?:json|\d+\.partial)$")
"""A status file's name (or its half-written ``.partial``), keyed by its engine core's pid."""

STATUS_FIELDS = ("phase", "epoch", "removed_ranks")
FILE_FIELDS = (*STATUS_FIELDS, "attempts")
REDUNDANCY = "redundancy"


def file_fields(
    status: Mapping[str, object], redundancy: RedundancyFacts | None = None
) -> dict[str, object]:
    """What a worker writes to its :class:`StatusFile`: an ``EngineStatus.to_dict()``
    subset and its ``redundancy`` facts (None: unknown, e.g. EPLB off)."""
    fields = {key: status.get(key) for key in FILE_FIELDS}
    fields[REDUNDANCY] = None if redundancy is None else attrs.asdict(redundancy)
    return fields


def redundancy_facts(fields: Mapping[str, object]) -> RedundancyFacts | None:
    """The worker's redundancy facts from its status file's ``fields`` (None: unknown,
    which a policy takes as "the survivors can host every expert"); ``ConfigError`` for
    facts that are not :class:`RedundancyFacts`' (a worker of another version)."""
    raw = fields.get(REDUNDANCY)
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"status file: expected redundancy facts (an object), found {raw!r}")
    try:
        return RedundancyFacts(**{str(key): value for key, value in raw.items()})
    except TypeError as exc:
        raise ConfigError(f"status file: unreadable redundancy facts {dict(raw)!r}") from exc


def worker_fields(status: Mapping[str, object]) -> dict[str, object]:
    """The ftengine fields an engine's vLLM status carries, from ``EngineStatus.to_dict()``."""
    return {key: status.get(key) for key in STATUS_FIELDS}


def _status_path(engine_core_pid: int, dp_rank: int) -> Path:
    return Path(tempfile.gettempdir()) / f"ftengine-status-{engine_core_pid}-{dp_rank}.json"


def _is_engine_core(pid: int) -> bool:
    try:
        return " ".join(psutil.Process(pid).cmdline()).startswith(ENGINE_CORE_TITLE)
    except psutil.Error:
        return False


def remove_dead_status_files() -> list[Path]:
    """Remove the status files (and half-written ones) whose engine core no longer runs (a
    SIGKILLed deployment cannot clean up after itself); returns what was removed."""
    removed: list[Path] = []
    for path in Path(tempfile.gettempdir()).glob("ftengine-status-*"):
        match = STATUS_NAME.fullmatch(path.name)
        if match is None or psutil.pid_exists(int(match["pid"])):
            continue
        with contextlib.suppress(FileNotFoundError):  # a peer's agent was quicker
            path.unlink()
            removed.append(path)
    return removed


@attrs.frozen
class StatusFile:
    """Where a worker's FSM leaves its phase, epoch and removed ranks for its engine core
    (same host, parent process): written whole and renamed, so a reader never sees half."""

    path: Path

    @classmethod
    def for_worker(cls, dp_rank: int) -> StatusFile | None:
        """The file of this worker's engine core, or None where the parent is no vLLM
        engine core (a stand-in in tests): nobody would read that file, nor remove it."""
        parent = os.getppid()
        return cls(_status_path(parent, dp_rank)) if _is_engine_core(parent) else None

    @classmethod
    def for_engine_core(cls, dp_rank: int) -> StatusFile:
        return cls(_status_path(os.getpid(), dp_rank))

    def write(self, fields: Mapping[str, object]) -> None:
        partial = self.path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(dict(fields)))
        partial.replace(self.path)

    def read(self) -> dict[str, object]:
        try:
            loaded = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}
