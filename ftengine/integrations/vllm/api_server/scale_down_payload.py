"""The API server's shape check of a ``scale_down`` command (``{"removed_dp_ranks": [int,
...]}``), run by the FT router's patched payload check (``patches/api_server.py``); the
engine core checks the rest (``engine_core/scale_down.py``)."""

from __future__ import annotations

from typing import Any

from ftengine.commands import parse_command

INSTRUCTION = "scale_down"


def check_payload(instruction: str, params: dict[str, Any]) -> None:
    """The router's shape check of a ``scale_down``; raises ``CommandRejected`` saying what
    was expected (the router turns it into a 400)."""
    if instruction == INSTRUCTION:
        parse_command(instruction, params)
