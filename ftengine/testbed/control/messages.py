"""Fault-tolerance messages in vLLM's REST dialect, and their validation.

``POST /fault_tolerance/apply`` bodies are judged by vLLM's rules, with vLLM's messages
(body an object, ``instruction`` given and known, ``params`` an object), then by
ftengine's range checks; ``GET /fault_tolerance/status`` is vLLM's object (lower-case
status names, ``fault_info`` only while unhealthy) plus ftengine's extra fields. One
msgspec struct per body both documents it (OpenAPI) and checks what the server sends.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, cast, get_args

import attrs
import msgspec

from ftengine.faults import HealthStatus
from ftengine.testbed.control.errors import (
    ErrorResponse,
    InvalidCommand,
    clip,
    decode_json,
    shorten,
)

logger = logging.getLogger(__name__)

INSTRUCTIONS: tuple[str, ...] = ("retry", "scale_down", "scale_up")
InstructionName = Literal["retry", "scale_down", "scale_up"]
MAX_REQUEST_ID_LEN = 128
ACCEPTED_MESSAGE = "Request accepted; poll /fault_tolerance/status for updates."
APPLY_PATH = "/fault_tolerance/apply"
STATUS_PATH = "/fault_tolerance/status"
REQUESTS_PATH = "/fault_tolerance/requests"  # ftengine's: one command's record
BODY_FIELDS = frozenset({"instruction", "params", "request_id"})

REQUEST_ID_CHARS = r"[A-Za-z0-9._~:-]"
REQUEST_ID_PATTERN = re.compile(f"{REQUEST_ID_CHARS}{{1,{MAX_REQUEST_ID_LEN}}}")
RequestId = Annotated[
    str,
    msgspec.Meta(
        min_length=1, max_length=MAX_REQUEST_ID_LEN, pattern=f"^{REQUEST_ID_PATTERN.pattern}$"
    ),
]
HealthName = Literal["healthy", "unhealthy", "dead"]


class FaultToleranceRequest(msgspec.Struct, kw_only=True):
    """``POST /fault_tolerance/apply`` body (vLLM's ``FaultToleranceRequest``).

    ``params`` is ``{}`` for ``retry`` and ``{"removed_dp_ranks": [int, ...]}`` (original
    DP ranks, cumulative) for ``scale_down``, which vLLM 0.33 does not accept yet
    (upstream PR #46370 adds it); ``{"added_dp_ranks": [int, ...]}`` for ``scale_up``,
    ftengine's extension (removed ranks that restarted and are ready come back).
    ``request_id`` is ftengine's extension: vLLM ignores it and always makes one; ftengine
    honours it for idempotent replay. Other fields are ignored, as vLLM ignores them.
    """

    instruction: InstructionName
    params: dict[str, Any] = msgspec.field(default_factory=dict)
    request_id: RequestId | None = None


class FaultToleranceResult(msgspec.Struct, kw_only=True):
    """The outcome of one command (vLLM's ``FaultToleranceResult``)."""

    request_id: str
    success: bool
    reason: str | None = None


class ApplyAccepted(msgspec.Struct, kw_only=True):
    """vLLM's 202 answer (``message``, ``request_id``) plus ftengine's ``state`` (``running``
    for a replay of a command still running) and the URL of the command's record."""

    message: str = ACCEPTED_MESSAGE
    request_id: str
    state: Literal["accepted", "running"]
    result_url: str


class CommandRecord(msgspec.Struct, kw_only=True):
    """``GET /fault_tolerance/requests/{request_id}`` (ftengine's): one command and, once
    done, its result."""

    request_id: str
    instruction: str
    params: dict[str, Any]
    state: Literal["running", "done"]
    result: FaultToleranceResult | None = None


class EngineStatusBody(msgspec.Struct, kw_only=True):
    """One engine in ``GET /fault_tolerance/status``: vLLM's fields, then ftengine's."""

    id: int
    status: HealthName
    fault_info: Annotated[
        str | None, msgspec.Meta(description="present only while unhealthy (vLLM)")
    ] = None
    last_ft_request_id: Annotated[
        str | None, msgspec.Meta(description="the last command this engine took part in")
    ] = None
    ft_error: Annotated[
        str | None, msgspec.Meta(description="why that command failed (absent: it did not)")
    ] = None
    phase: str
    removed_ranks: list[int]
    epoch: int
    attempts: int = 0
    timeline: Annotated[
        dict[str, Any] | None,
        msgspec.Meta(description="the current (or last) fault episode: Timeline.to_dict()"),
    ] = None
    fault_episodes: Annotated[
        int, msgspec.Meta(description="fault episodes this engine had so far (cumulative)")
    ] = 0
    episodes: Annotated[
        list[dict[str, Any]] | None,
        msgspec.Meta(
            description="the engine's recent fault episodes, oldest first, each as last "
            "reported (Timeline.to_dict()); includes the current one"
        ),
    ] = None
    pid: Annotated[int | None, msgspec.Meta(description="the worker process")] = None
    alive: Annotated[bool, msgspec.Meta(description="its process is running")] = True


class StatusBody(msgspec.Struct, kw_only=True):
    """``GET /fault_tolerance/status`` (vLLM's shape; ``running_request_id`` is ftengine's)."""

    schema_version: int
    total_engines: int
    engines: list[EngineStatusBody]
    running_request_id: str | None = None


class HealthBody(msgspec.Struct, kw_only=True):
    """``GET /health``: ``healthy`` only when every live engine is HEALTHY and none recovers."""

    healthy: bool
    live_engines: list[int]
    unhealthy_engines: list[int]
    running_request_id: str | None = None
    detail: str | None = None


SCHEMA_STRUCTS: tuple[type[msgspec.Struct], ...] = (
    FaultToleranceRequest,
    FaultToleranceResult,
    ApplyAccepted,
    CommandRecord,
    ErrorResponse,
    StatusBody,
    HealthBody,
)


@attrs.frozen
class Command:
    """A validated command: ``removed_dp_ranks`` (``scale_down``) or ``added_dp_ranks``
    (``scale_up``) sorted, both empty for ``retry``."""

    instruction: str
    request_id: str
    removed_dp_ranks: tuple[int, ...] = ()
    added_dp_ranks: tuple[int, ...] = ()

    def params(self) -> dict[str, object]:
        """The params dict to hand to ``Cluster.apply``."""
        if self.instruction == "scale_down":
            return {"removed_dp_ranks": list(self.removed_dp_ranks)}
        if self.instruction == "scale_up":
            return {"added_dp_ranks": list(self.added_dp_ranks)}
        return {}


def decode_request(body: bytes) -> FaultToleranceRequest:
    """Decode an apply body by vLLM's rules and messages (the first sentence of each is
    vLLM's own), plus the optional ``request_id`` of ftengine's replay extension."""
    raw = decode_json(body)
    if not isinstance(raw, dict):
        raise InvalidCommand(
            f"Request body must be a JSON object. Found {type(raw).__name__}: send "
            '{"instruction": "retry"|"scale_down"|"scale_up", "params": {...}}'
        )
    instruction = _instruction(raw.get("instruction"))
    params = raw.get("params", {})
    if not isinstance(params, dict):
        raise InvalidCommand(
            f"'params' must be an object. Found {type(params).__name__}.", param="params"
        )
    request_id = _request_id(raw.get("request_id"))
    ignored = sorted(set(raw) - BODY_FIELDS)
    if ignored:
        logger.warning("apply body fields %s are ignored (as vLLM ignores them)", clip(ignored))
    return FaultToleranceRequest(instruction=instruction, params=params, request_id=request_id)


def _instruction(value: object) -> InstructionName:
    expected = "Expected one of " + ", ".join(repr(name) for name in INSTRUCTIONS)
    if not value:
        found = "" if value is None else f" Found {clip(value)}; {expected}"
        raise InvalidCommand(f"'instruction' is required.{found}", param="instruction")
    for name in get_args(InstructionName):
        if value == name:
            return cast(InstructionName, name)
    shown = shorten(value) if isinstance(value, str) else clip(value)
    raise InvalidCommand(f"Invalid instruction: '{shown}'. {expected}", param="instruction")


def _request_id(value: object) -> str | None:
    # The id travels in a URL path (result_url) and in log lines: only URL-safe characters,
    # so that every accepted command's record can be fetched and no id forges a log line.
    if value is None or (isinstance(value, str) and REQUEST_ID_PATTERN.fullmatch(value)):
        return value
    raise InvalidCommand(
        f"'request_id' must be a string of 1 to {MAX_REQUEST_ID_LEN} characters from "
        f"A-Z a-z 0-9 . _ ~ : - (or absent: the server then makes one); found {clip(value)}",
        param="request_id",
    )


def validate_request(
    request: FaultToleranceRequest,
    request_id: str,
    *,
    world_size: int,
    removed: frozenset[int] = frozenset(),
    ready: frozenset[int] | None = None,
) -> Command:
    """Check params against a cluster of ``world_size`` DP ranks with ``removed`` already gone.

    Only shape and range are checked here; state preconditions (survivors UNHEALTHY, a
    newly dead rank) are the engines' to judge, and they answer with a recorded result.
    ``scale_up`` is also checked against ``removed`` and the ``ready`` ranks when they are
    given (None: a replay, compared with its record rather than re-judged).
    """
    if request.instruction == "retry":
        if request.params:
            raise InvalidCommand(
                f'retry takes no params; found {clip(sorted(request.params))}: send "params": {{}}',
                param="params",
            )
        return Command("retry", request_id)
    if request.instruction == "scale_up":
        added = _ranks(request.params, world_size, "scale_up", "added_dp_ranks", "removed")
        if ready is not None:
            _check_admissible(added, removed, ready)
        return Command("scale_up", request_id, added_dp_ranks=added)
    ranks = _removed_ranks(request.params, world_size)
    if removed | frozenset(ranks) >= frozenset(range(world_size)):
        raise InvalidCommand(
            f"removed_dp_ranks {list(ranks)} (with {sorted(removed)} already removed) would remove "
            f"every one of the {world_size} DP ranks; at least one rank must survive",
            param=RANKS_PARAM,
        )
    return Command("scale_down", request_id, ranks)


RANKS_PARAM = "params.removed_dp_ranks"
ADDED_PARAM = "params.added_dp_ranks"


def _check_admissible(
    added: tuple[int, ...], removed: frozenset[int], ready: frozenset[int]
) -> None:
    not_removed = sorted(set(added) - removed)
    if not_removed:
        raise InvalidCommand(
            f"added_dp_ranks {not_removed} were not removed (removed: {sorted(removed)}); "
            "only a removed rank that restarted can be admitted",
            param=ADDED_PARAM,
        )
    waiting = sorted(set(added) - ready)
    if waiting:
        raise InvalidCommand(
            f"added_dp_ranks {waiting} are not ready: restart them and wait until they report "
            f"ready (ready: {sorted(ready)})",
            param=ADDED_PARAM,
        )


def _removed_ranks(params: Mapping[str, Any], world_size: int) -> tuple[int, ...]:
    return _ranks(params, world_size, "scale_down", "removed_dp_ranks", "dead")


def _ranks(
    params: Mapping[str, Any], world_size: int, instruction: str, key: str, which: str
) -> tuple[int, ...]:
    param = f"params.{key}"
    extra = sorted(set(params) - {key})
    if extra:
        raise InvalidCommand(
            f"{instruction} takes only {key!r}; found unexpected params {clip(extra)}",
            param="params",
        )
    value = params.get(key)
    # bool is an int subclass; JSON true must not pass as rank 1.
    if not isinstance(value, list) or not all(type(rank) is int for rank in value):
        raise InvalidCommand(
            f"{instruction} needs params.{key} as a list of integer DP ranks, "
            f"e.g. [3]; found {clip(value)}",
            param=param,
        )
    if not value:
        raise InvalidCommand(f"{key} is empty: name at least one {which} DP rank", param=param)
    if len(set(value)) != len(value):
        raise InvalidCommand(
            f"{key} {clip(value)} repeats a rank; list each rank once", param=param
        )
    outside = sorted(rank for rank in value if not 0 <= rank < world_size)
    if outside:
        raise InvalidCommand(
            f"{key} {clip(outside)} are out of range: this cluster has DP ranks "
            f"0..{world_size - 1} (original rank ids)",
            param=param,
        )
    return tuple(sorted(value))


def engine_wire(raw: Mapping[str, Any], last: FaultToleranceResult | None) -> dict[str, Any]:
    """One engine of a cluster status dict as vLLM sends it: ``status`` by lower-case name,
    ``fault_info`` only while unhealthy, ``last_ft_request_id`` / ``ft_error`` only when
    set. When the server's last finished command (``last``) failed, it fills them for an
    engine that did not record that command itself, as vLLM's client does after a failed
    command: one refused before it reached the engines (retry while a rank is DEAD) still
    shows on every engine."""
    engine = dict(raw)
    health = HealthStatus(int(engine["status"]))
    engine["status"] = health.name.lower()
    if health is not HealthStatus.UNHEALTHY:
        engine.pop("fault_info", None)
    failed = last is not None and not last.success
    if failed and last is not None and engine.get("last_ft_request_id") != last.request_id:
        engine["last_ft_request_id"] = last.request_id
        engine["ft_error"] = last.reason
    for key in ("fault_info", "last_ft_request_id", "ft_error"):
        if engine.get(key) is None:
            engine.pop(key, None)
    return engine
