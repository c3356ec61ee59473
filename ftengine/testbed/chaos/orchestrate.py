"""Recovery the way an orchestrator drives it, through the HTTP API only: poll
``/fault_tolerance/status``; once no live engine serves and every live one is
``quarantined``, ``scale_down`` past the dead ranks (cumulative ``removed_dp_ranks``) or,
with none dead, ``retry``; repeat until every live engine is ``healthy`` with the dead
removed, or some engine ended ``dead`` (the campaign rebuilds then). With ``--policy auto``
it only watches."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import attrs
import httpx

from ftengine.testbed.chaos.history import History

POLL_S = 0.02


@attrs.frozen
class Outcome:
    """How a recovery ended: ``settled`` (every live engine healthy, the dead removed),
    ``dead`` (some live engine's engine is DEAD: terminal), or ``stuck`` (neither before
    the deadline); the engines as last seen and the commands sent."""

    state: str  # settled | dead | stuck
    at: float
    engines: tuple[dict[str, Any], ...]
    commands: tuple[str, ...]


def _engines(http: httpx.Client) -> list[dict[str, Any]]:
    return list(http.get("/fault_tolerance/status").json()["engines"])


def settled_state(engines: list[dict[str, Any]]) -> str | None:
    """``settled`` (every live engine healthy, every dead rank removed and every removed
    rank reads dead), ``dead`` (an engine ended DEAD and none is still unhealthy), or None
    (recovery is still running)."""
    gone = {e["id"] for e in engines if not e.get("alive", True)}
    live = [e for e in engines if e["id"] not in gone]
    if not live or all(e["status"] == "dead" for e in live):
        return "dead"
    statuses = {e["status"] for e in live}
    if "dead" in statuses:
        return None if "unhealthy" in statuses else "dead"
    removed = set(live[0].get("removed_ranks") or ())
    dead = {e["id"] for e in engines if e["status"] == "dead"}
    if statuses == {"healthy"} and dead <= removed and removed <= dead:
        return "settled"
    return None


def _hung_peer_suspected(engines: list[dict[str, Any]]) -> bool:
    for engine in engines:
        timeline = engine.get("timeline") or {}
        if any(f.get("kind") == "hung_peer" for f in timeline.get("faults") or ()):
            return True
    return False


def _command(
    engines: list[dict[str, Any]], waited_s: float = float("inf"), grace_s: float = 0.0
) -> tuple[str, dict[str, Any]] | None:
    """The command to send now, or None (someone still serves, recovery is running, or a
    hung peer is suspected and the supervisor has had less than ``grace_s`` of the
    ``waited_s`` so far to fence it: a retry would wait for that peer)."""
    live = [e for e in engines if e["status"] != "dead"]
    if not live or any(e["phase"] != "quarantined" for e in live):
        return None
    dead = {e["id"] for e in engines if e["status"] == "dead"}
    removed = set(live[0].get("removed_ranks") or ())
    if dead - removed:
        return "scale_down", {"removed_dp_ranks": sorted(dead | removed)}
    if waited_s < grace_s and _hung_peer_suspected(live):
        return None
    return "retry", {}


class Orchestrator:
    """Drives one deployment's recovery over HTTP (``auto``: watches only)."""

    def __init__(self, url: str, *, auto: bool, history: History, grace_s: float = 0.0) -> None:
        self.http = httpx.Client(base_url=url, timeout=120.0)
        self.grace_s = grace_s  # how long a suspected hung peer gets to be fenced
        self.auto = auto
        self.history = history

    def close(self) -> None:
        self.http.close()

    def state(self) -> str | None:
        """``settled``, ``dead`` or None (a recovery is running or due), as
        :meth:`recover` reads the engines over HTTP."""
        return settled_state(_engines(self.http))

    def recover(
        self, fault: int | None, deadline_s: float, on_command: Callable[[], None] | None = None
    ) -> Outcome:
        """Drive recovery until it settles, ends dead, or ``deadline_s`` passes;
        ``on_command`` runs once, right after the first command was accepted (or, with
        auto, once a live engine is recovering): the campaign's recovery-phase fault."""
        deadline, commands = time.monotonic() + deadline_s, list[str]()
        hooks = [] if on_command is None else [on_command]  # popped: fires at most once
        started = time.monotonic()
        while True:
            engines = _engines(self.http)
            state = settled_state(engines)
            if state is None and time.monotonic() > deadline:
                state = "stuck"
            if state is not None:
                return Outcome(state, time.monotonic(), tuple(engines), tuple(commands))
            recovering = any(e["phase"] in ("retrying", "scaling_down") for e in engines)
            if hooks and self.auto and recovering:
                hooks.pop()()
            waited = time.monotonic() - started
            command = None if self.auto else _command(engines, waited, self.grace_s)
            if command is not None:
                request_id = self._send(fault, *command)
                if hooks:
                    hooks.pop()()
                commands.append(self._result(fault, request_id, deadline))
            time.sleep(POLL_S)

    def _send(self, fault: int | None, instruction: str, params: dict[str, Any]) -> str:
        request_id = f"chaos-{uuid.uuid4().hex[:12]}"
        body = {"instruction": instruction, "params": params, "request_id": request_id}
        answer = self.http.post("/fault_tolerance/apply", json=body)
        self.history.add(
            "command",
            fault,
            instruction=instruction,
            params=params,
            http=answer.status_code,
            request_id=request_id,
        )
        return request_id

    def _result(self, fault: int | None, request_id: str, deadline: float) -> str:
        """Wait for the command's result (a 404: it was refused before it ran)."""
        while time.monotonic() < deadline:
            record = self.http.get(f"/fault_tolerance/requests/{request_id}")
            if record.status_code != 200 or record.json().get("state") == "done":
                result = record.json().get("result") if record.status_code == 200 else None
                self.history.add("command_done", fault, request_id=request_id, result=result)
                return f"{request_id}: {result}"
            time.sleep(POLL_S)
        self.history.add("command_stuck", fault, request_id=request_id)
        return f"{request_id}: still running at the deadline"
