"""The API server's shape check of ftengine's commands (vLLM 0.32 accepts only ``retry``):
``scale_down`` (``{"removed_dp_ranks": [int, ...]}``) and ``scale_up`` (``{"added_dp_ranks":
[int, ...]}``, plus ``"dp_store": "host:port"`` for the returning rank), run by the FT
router's patched payload check (``patches/api_server.py``); the engine core checks the rest
(``engine_core/scale_down.py``, ``engine_core/admission.py``)."""

from __future__ import annotations

from typing import Any

from ftengine.commands import parse_command
from ftengine.integrations.vllm.engine_core.admission import DP_STORE_KEY, parse_store

INSTRUCTION = "scale_down"
INSTRUCTIONS = (INSTRUCTION, "scale_up")
"""The instructions ftengine adds to vLLM's router."""


def check_payload(instruction: str, params: dict[str, Any]) -> None:
    """The router's shape check of an added instruction; raises ``CommandRejected`` saying
    what was expected (the router turns it into a 400)."""
    if instruction not in INSTRUCTIONS:
        return
    params = dict(params)
    if instruction == "scale_up" and DP_STORE_KEY in params:
        parse_store(params.pop(DP_STORE_KEY))
    parse_command(instruction, params)
