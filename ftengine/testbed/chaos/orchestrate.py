"""The CPU cluster's side of recovery (``recovery.Orchestrator`` drives it), through the
HTTP API only: poll ``/fault_tolerance/status``; once no live engine serves and every live
one is ``quarantined``, ``scale_down`` past the dead ranks (cumulative
``removed_dp_ranks``) or, with none dead, ``retry``; repeat until every live engine is
``healthy`` with the dead removed, or some engine ended ``dead`` (the campaign rebuilds
then). With ``--policy auto`` it only watches."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import attrs
import httpx

from ftengine.testbed.chaos.history import History
from ftengine.testbed.chaos.recovery import Decision, Engines


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


@attrs.define
class ClusterRules:
    """One recovery's rules on the cluster (``auto``: its engines recover themselves, the
    orchestrator only watches; ``grace_s``: how long a suspected hung peer gets to be fenced
    by the supervisor, counted from ``started``)."""

    auto: bool
    grace_s: float
    started: float = attrs.field(factory=time.monotonic)

    def __call__(self, engines: Engines, may_die: Sequence[int], now: float) -> Decision:
        seen = [dict(e) for e in engines.values()]
        state = settled_state(seen)
        if state is not None:
            return Decision("done", state=state)
        if self.auto:
            recovering = any(e["phase"] in ("retrying", "scaling_down") for e in seen)
            return Decision("watch" if recovering else "wait")
        command = _command(seen, now - self.started, self.grace_s)
        if command is None:
            return Decision("wait")
        return Decision("command", (), command[0], command[1])


class ClusterChannel:
    """The cluster's one HTTP endpoint: commands go to ``/fault_tolerance/apply`` and their
    results are read back from ``/fault_tolerance/requests/<id>``."""

    poll_s = 0.02

    def __init__(self, url: str, history: History) -> None:
        self.http = httpx.Client(base_url=url, timeout=120.0)
        self.history = history

    def close(self) -> None:
        self.http.close()

    def read(self) -> Engines:
        engines = self.http.get("/fault_tolerance/status").json()["engines"]
        return {int(e["id"]): e for e in engines}

    def send(self, fault: int | None, decision: Decision, engines: Engines) -> str:
        request_id = f"chaos-{uuid.uuid4().hex[:12]}"
        instruction, params = decision.instruction, decision.params
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

    def finish(self, fault: int | None, handle: str, until: float) -> str:
        """Wait for the command's result (a 404: it was refused before it ran)."""
        while time.monotonic() < until:
            record = self.http.get(f"/fault_tolerance/requests/{handle}")
            if record.status_code != 200 or record.json().get("state") == "done":
                result = record.json().get("result") if record.status_code == 200 else None
                self.history.add("command_done", fault, request_id=handle, result=result)
                return f"{handle}: {result}"
            time.sleep(self.poll_s)
        self.history.add("command_stuck", fault, request_id=handle)
        return f"{handle}: still running at the deadline"

    def fence(self, fault: int | None, ranks: Sequence[int]) -> None:
        raise RuntimeError(
            f"asked to fence ranks {list(ranks)} of the cluster: its supervisor fences its own "
            "workers, and the cluster's rules never ask"
        )
