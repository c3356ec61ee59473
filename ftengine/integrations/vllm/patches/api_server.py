"""The vLLM name ftengine replaces in vLLM's API server: the FT router's payload check, so
that ``scale_down`` (vLLM 0.32 has only ``retry``) passes it, and a malformed one is a 400
with vLLM's error object, as vLLM answers a malformed ``retry``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ftengine.errors import CommandRejected
from ftengine.integrations.vllm.api_server.scale_down_payload import INSTRUCTION, check_payload
from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.patches.mechanism import PATCHED_MARK, Patch

ROUTER_MODULE = "vllm.entrypoints.serve.fault_tolerance.api_router"


def _checking_scale_down(validate: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(validate)
    def validate_or_scale_down(body: Any) -> Any:
        if not isinstance(body, dict) or body.get("instruction") != INSTRUCTION:
            return validate(body)  # vLLM's own checks and messages
        params = body.get("params", {})
        try:
            if not isinstance(params, dict):
                raise CommandRejected("'params' must be an object.")
            check_payload(INSTRUCTION, params)
        except CommandRejected as exc:  # vLLM's own answer to a malformed command: 400
            raise import_vllm("fastapi").HTTPException(400, str(exc)) from exc
        return INSTRUCTION, params

    setattr(validate_or_scale_down, PATCHED_MARK, validate)
    return validate_or_scale_down


SCALE_DOWN_PATCHES = (
    Patch(ROUTER_MODULE, "", "_validate_payload", ("body",), _checking_scale_down),
)
