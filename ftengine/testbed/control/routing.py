"""What every route module shares: JSON answers encoded from the documented structs, the
key-check dependency's type, and the documented error answers."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from fastapi import Response

from ftengine.testbed.control.errors import ErrorResponse

RequireKey = Callable[..., None]
"""The FastAPI dependency that refuses a request without the server's bearer key."""

UNAUTHORIZED = (
    401,
    ("missing or wrong bearer key (only when the server has a key)", ErrorResponse),
)
BAD_INPUT = (400, ("bad input, naming the field at fault; nothing changed", ErrorResponse))
TOO_LARGE = (
    413,
    (
        "the body is over the size bound (refused before it is parsed); nothing changed",
        ErrorResponse,
    ),
)
TOO_SLOW = (408, ("the body did not arrive in time; nothing changed", ErrorResponse))
UNAVAILABLE = (503, ("the cluster cannot serve this now (recovering, or shut down)", ErrorResponse))


def json_response(
    status: int, body: msgspec.Struct, headers: dict[str, str] | None = None
) -> Response:
    """``body`` encoded by msgspec (the struct the schema documents)."""
    return Response(msgspec.json.encode(body), status, headers, media_type="application/json")
