"""Reading a POST body at the API edge, before anything parses it: the media type must be
JSON (vLLM's ``validate_json_request``), and the size is bounded while the body streams in
(a declared ``Content-Length`` over the bound is refused before one byte is read), so a
huge body costs the server at most the bound. Refusals are the routes' error objects.
"""

from __future__ import annotations

from http import HTTPStatus

import anyio
from fastapi import Request

from ftengine.testbed.control.errors import ApiError, InvalidRequest, clip

MAX_BODY_BYTES = 4 * 1024 * 1024
"""The largest POST body accepted: 64 prompts of a few thousand token ids fit with room."""


BODY_TIMEOUT_S = 30.0
"""How long a client may take to send a whole body: a stalled one must not hold a request
(and its connection) forever."""


class BodyTimeout(ApiError):
    """A POST body that did not arrive in time (HTTP 408); nothing was parsed or changed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=HTTPStatus.REQUEST_TIMEOUT)


class BodyTooLarge(ApiError):
    """A POST body over the bound (HTTP 413); nothing was parsed or changed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)


def check_media_type(content_type: str | None) -> None:
    """vLLM's ``validate_json_request``: a POST body must be ``application/json``."""
    media = (content_type or "").lower().split(";", maxsplit=1)[0].strip()
    if media != "application/json":
        raise InvalidRequest(
            "Unsupported Media Type: Only 'application/json' is allowed "
            f"(found content-type {clip(content_type)})"
        )


async def read_json_body(
    request: Request, limit: int = MAX_BODY_BYTES, timeout_s: float = BODY_TIMEOUT_S
) -> bytes:
    """The body of a JSON POST, read only as far as ``limit`` bytes and for ``timeout_s``
    seconds; raises InvalidRequest (wrong media type, bad ``Content-Length``), BodyTooLarge
    or BodyTimeout."""
    check_media_type(request.headers.get("content-type"))
    declared = _declared_length(request.headers.get("content-length"))
    if declared is not None and declared > limit:
        raise BodyTooLarge(_too_large(f"declared as {declared} bytes", limit))
    try:
        with anyio.fail_after(timeout_s):
            return await _read_bounded(request, limit)
    except TimeoutError as exc:
        raise BodyTimeout(
            f"the request body did not arrive within {timeout_s:g} s; send it whole"
        ) from exc


async def _read_bounded(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    # Counted as it streams: a chunked body has no Content-Length to trust.
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(_too_large(f"over {limit} bytes so far", limit))
        chunks.append(chunk)
    return b"".join(chunks)


def _declared_length(value: str | None) -> int | None:
    if value is None:
        return None
    digits = value.strip()
    if not (digits.isascii() and digits.isdigit()):
        raise InvalidRequest(f"Content-Length must be a byte count, found {clip(value)}")
    return int(digits)


def _too_large(found: str, limit: int) -> str:
    return f"request body is {found}; the limit is {limit} bytes: send fewer or shorter prompts"
