"""Control-plane messages (vLLM's fault-tolerance shapes) and their validation.

Bodies are msgspec structs so one definition both decodes requests and produces the
OpenAPI schema; ``validate_request`` checks a decoded request against the cluster's size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import attrs
import msgspec

from ftengine.errors import FTEngineError

INSTRUCTIONS: tuple[str, ...] = ("retry", "scale_down")
MAX_REQUEST_ID_LEN = 128
MAX_PROMPT_TOKENS = 4096
MAX_NEW_TOKENS = 1024

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_LEN)]


class InvalidRequest(FTEngineError, ValueError):
    """A request body is malformed or out of range (HTTP 422); nothing was changed."""


class InvalidCommand(InvalidRequest):
    """A fault-tolerance command is malformed or names ranks the cluster does not have."""


class FaultToleranceRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/fault_tolerance/apply`` body (vLLM's ``FaultToleranceRequest``).

    ``params`` is ``{}`` for ``retry`` and ``{"removed_dp_ranks": [int, ...]}`` (original
    DP ranks, cumulative) for ``scale_down``.
    """

    instruction: Literal["retry", "scale_down"]
    params: dict[str, Any] = msgspec.field(default_factory=dict)
    request_id: RequestId


class FaultToleranceResult(msgspec.Struct, kw_only=True):
    """The outcome of one command (vLLM's ``FaultToleranceResult``)."""

    request_id: str
    success: bool
    reason: str | None = None


class ApplyAccepted(msgspec.Struct, kw_only=True):
    """Answer to an accepted (or still running, replayed) command: recovery runs in background."""

    request_id: str
    state: Literal["accepted", "running"]
    result_url: str


class CommandRecord(msgspec.Struct, kw_only=True):
    """``GET /v1/fault_tolerance/requests/{request_id}``: one command and, once done, its result."""

    request_id: str
    instruction: str
    params: dict[str, Any]
    state: Literal["running", "done"]
    result: FaultToleranceResult | None = None


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/generate`` body: prompt token ids in, greedy continuation out."""

    prompt_token_ids: Annotated[
        list[Annotated[int, msgspec.Meta(ge=0)]],
        msgspec.Meta(min_length=1, max_length=MAX_PROMPT_TOKENS),
    ]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)] = 16


class GenerateResponse(msgspec.Struct, kw_only=True):
    """Generated token ids (without the prompt) and the wall time in seconds."""

    token_ids: list[int]
    seconds: float


class ErrorBody(msgspec.Struct, kw_only=True):
    """Every 4xx/5xx answer: ``detail`` says what was expected, what was found, what to do."""

    detail: str


class EngineStatusBody(msgspec.Struct, kw_only=True):
    """One engine in ``GET /v1/fault_tolerance/status`` (vLLM's fields plus ftengine's)."""

    id: int
    status: Annotated[int, msgspec.Meta(description="0 HEALTHY, 1 DEAD, 2 UNHEALTHY (vLLM)")]
    fault_info: str | None = None
    last_ft_request_id: str | None = None
    ft_error: str | None = None
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


class StatusBody(msgspec.Struct, kw_only=True):
    """``GET /v1/fault_tolerance/status`` (vLLM's shape; ``running_request_id`` is ftengine's)."""

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
    GenerateRequest,
    GenerateResponse,
    ErrorBody,
    StatusBody,
    HealthBody,
)


@attrs.frozen
class Command:
    """A validated command: ``removed_dp_ranks`` is sorted, empty for ``retry``."""

    instruction: str
    request_id: str
    removed_dp_ranks: tuple[int, ...] = ()

    def params(self) -> dict[str, object]:
        """The params dict to hand to ``Cluster.apply``."""
        if self.instruction == "scale_down":
            return {"removed_dp_ranks": list(self.removed_dp_ranks)}
        return {}


def decode_request(body: bytes) -> FaultToleranceRequest:
    """Decode an apply body, naming what is wrong (bad JSON, unknown instruction, bad field)."""
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidCommand(
            f"request body is not valid JSON ({exc}); send "
            '{"instruction": "retry"|"scale_down", "params": {...}, "request_id": "..."}'
        ) from exc
    if isinstance(raw, Mapping) and "instruction" in raw and raw["instruction"] not in INSTRUCTIONS:
        raise InvalidCommand(
            f"unknown instruction {raw['instruction']!r}: expected one of "
            + ", ".join(repr(name) for name in INSTRUCTIONS)
        )
    try:
        return msgspec.convert(raw, FaultToleranceRequest)
    except msgspec.ValidationError as exc:
        raise InvalidCommand(f"request body does not match FaultToleranceRequest: {exc}") from exc


def validate_request(
    request: FaultToleranceRequest, *, world_size: int, removed: frozenset[int] = frozenset()
) -> Command:
    """Check params against a cluster of ``world_size`` DP ranks with ``removed`` already gone.

    Only shape and range are checked here; state preconditions (survivors UNHEALTHY, a
    newly dead rank) are the engines' to judge, and they answer with a recorded result.
    """
    if request.instruction == "retry":
        if request.params:
            raise InvalidCommand(
                f'retry takes no params; found {sorted(request.params)}: send "params": {{}}'
            )
        return Command("retry", request.request_id)
    ranks = _removed_ranks(request.params, world_size)
    if removed | frozenset(ranks) >= frozenset(range(world_size)):
        raise InvalidCommand(
            f"removed_dp_ranks {list(ranks)} (with {sorted(removed)} already removed) would remove "
            f"every one of the {world_size} DP ranks; at least one rank must survive"
        )
    return Command("scale_down", request.request_id, ranks)


def _removed_ranks(params: Mapping[str, Any], world_size: int) -> tuple[int, ...]:
    extra = sorted(set(params) - {"removed_dp_ranks"})
    if extra:
        raise InvalidCommand(
            f"scale_down takes only 'removed_dp_ranks'; found unexpected params {extra}"
        )
    value = params.get("removed_dp_ranks")
    # bool is an int subclass; JSON true must not pass as rank 1.
    if not isinstance(value, list) or not all(type(rank) is int for rank in value):
        raise InvalidCommand(
            "scale_down needs params.removed_dp_ranks as a list of integer DP ranks, "
            f"e.g. [3]; found {value!r}"
        )
    if not value:
        raise InvalidCommand("removed_dp_ranks is empty: name at least one dead DP rank")
    if len(set(value)) != len(value):
        raise InvalidCommand(f"removed_dp_ranks {value} repeats a rank; list each rank once")
    outside = sorted(rank for rank in value if not 0 <= rank < world_size)
    if outside:
        raise InvalidCommand(
            f"removed_dp_ranks {outside} are out of range: this cluster has DP ranks "
            f"0..{world_size - 1} (original rank ids)"
        )
    return tuple(sorted(value))
