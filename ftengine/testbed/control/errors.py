"""vLLM's error object (``{"error": {"message", "type", "param", "code"}}``) and the
exceptions the API edge raises to produce it: each carries its HTTP status, its vLLM
``type`` and the request field (``param``) that was wrong.
"""

from __future__ import annotations

from http import HTTPStatus

import msgspec

from ftengine.errors import FTEngineError

# vLLM's fault-tolerance router raises HTTPException, whose handler names the type by the
# status phrase; its OpenAI routes raise VLLMValidationError ("BadRequestError").
FT_BAD_REQUEST = HTTPStatus.BAD_REQUEST.phrase
OPENAI_BAD_REQUEST = "BadRequestError"
MAX_ECHO_CHARS = 200


class ErrorInfo(msgspec.Struct, kw_only=True):
    """vLLM's ``ErrorInfo``: ``message`` says what was expected and what was found."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(msgspec.Struct, kw_only=True):
    """vLLM's ``ErrorResponse``: the body of every 4xx / 5xx answer."""

    error: ErrorInfo


class ApiError(FTEngineError):
    """An answer other than success: ``status``, vLLM ``err_type`` and the field at fault.

    Nothing was changed or started when one is raised.
    """

    def __init__(
        self,
        message: str,
        *,
        status: HTTPStatus,
        err_type: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type or status.phrase
        self.param = param

    def body(self) -> ErrorResponse:
        """The error object for this answer."""
        info = ErrorInfo(message=str(self), type=self.err_type, param=self.param, code=self.status)
        return ErrorResponse(error=info)


class InvalidRequest(ApiError, ValueError):
    """A request body is malformed or out of range (HTTP 400)."""

    def __init__(
        self, message: str, *, param: str | None = None, err_type: str = FT_BAD_REQUEST
    ) -> None:
        super().__init__(message, status=HTTPStatus.BAD_REQUEST, err_type=err_type, param=param)


class InvalidCommand(InvalidRequest):
    """A fault-tolerance command is malformed or names ranks the cluster does not have."""


class InvalidCompletion(InvalidRequest):
    """A completion request cannot be served as asked (vLLM's VLLMValidationError)."""

    def __init__(self, message: str, *, param: str | None, value: object = None) -> None:
        # vLLM appends "(parameter=..., value=...)" to the message of a validation error.
        extras = [f"parameter={param}"] if param is not None else []
        if value is not None:
            extras.append(f"value={shorten(str(value))}")
        text = f"{message} ({', '.join(extras)})" if extras else message
        super().__init__(text, param=param, err_type=OPENAI_BAD_REQUEST)


class ModelNotFound(ApiError, LookupError):
    """The request names a model this server does not serve (HTTP 404, as vLLM)."""

    def __init__(self, model: str, served: str) -> None:
        super().__init__(
            f"The model `{shorten(model)}` does not exist. Valid aliases: {served}.",
            status=HTTPStatus.NOT_FOUND,
            err_type="NotFoundError",
            param="model",
        )


def decode_json(body: bytes) -> object:
    """The JSON value of ``body``; vLLM's "Invalid JSON format" 400 when it is not JSON."""
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Invalid JSON format: {exc}") from exc
    except RecursionError as exc:
        # msgspec's decoder bounds nesting by the interpreter's recursion limit.
        raise InvalidRequest(
            f"Invalid JSON format: nested too deeply ({exc}); a request body needs at most "
            "a few levels of arrays and objects"
        ) from exc


def clip(value: object, limit: int = MAX_ECHO_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error message that echoes a client's
    value must not grow with the body (vLLM bounds its validation messages the same way)."""
    return shorten(repr(value), limit)


def shorten(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how many were cut."""
    return text if len(text) <= limit else f"{text[:limit]}...[{len(text) - limit} more chars]"
