"""Replayed and concurrent commands over HTTP: the same apply sent twice, or many times at
once, acts once; N concurrent applies of conflicting instructions start exactly one
command, the others get a clear 409 (or, sent with that one's own request_id, its
record), and the ledger, the status and the cluster agree afterwards."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgspec
from hypothesis import given
from hypothesis import strategies as st

from ftengine.testbed.control.errors import InvalidCommand
from ftengine.testbed.control.messages import decode_request, validate_request
from tests.strategies import commands
from tests.unit.control_harness import APPLY, REQUESTS, Api, error_object

REQUEST_TIMEOUT_S = 10.0


async def _send_all(api: Api, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    async with api.async_client() as client:
        sends = (client.post(APPLY, json=body) for body in bodies)
        return list(await asyncio.wait_for(asyncio.gather(*sends), REQUEST_TIMEOUT_S))


def send_concurrently(api: Api, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    """POST every body at once (the plane judges them on worker threads, truly in parallel)."""
    return asyncio.run(_send_all(api, bodies))


def well_formed(body: dict[str, Any]) -> bool:
    """Whether ``body`` passes the shape checks (state-independent: nothing is removed yet)."""
    try:
        validate_request(decode_request(msgspec.json.encode(body)), "x", world_size=4)
    except InvalidCommand:
        return False
    return True


def same_command(one: dict[str, Any], other: dict[str, Any]) -> bool:
    def key(body: dict[str, Any]) -> tuple[str, list[int]]:
        return body["instruction"], sorted(body["params"].get("removed_dp_ranks", []))

    return key(one) == key(other)


@given(st.lists(commands, min_size=2, max_size=8))
def test_concurrent_conflicting_applies_start_exactly_one(bodies: list[dict[str, Any]]) -> None:
    api = Api()
    api.cluster.kill(3)
    answers = send_concurrently(api, bodies)
    for body, answer in zip(bodies, answers, strict=True):
        assert answer.status_code in (202, 400, 409), answer.text
        assert (answer.status_code == 400) is not well_formed(body), (body, answer.text)
    started = [
        i for i, a in enumerate(answers) if a.status_code == 202 and a.json()["state"] == "accepted"
    ]
    if not any(well_formed(body) for body in bodies):
        assert started == [] and api.jobs.queue == [] and api.plane.ledger.entries() == ()
        return
    assert len(started) == 1, [a.text for a in answers]
    winner = bodies[started[0]]
    winner_id = answers[started[0]].json()["request_id"]
    for body, answer in zip(bodies, answers, strict=True):
        if answer.status_code == 202 and answer.json()["state"] == "running":
            # A replay of the running command: same request_id, same command.
            assert body.get("request_id") == winner_id and same_command(body, winner)
        elif answer.status_code == 409:
            message = error_object(answer)["message"]
            assert f"command {winner_id!r} is still running" in message or (
                f"request_id {winner_id!r} was already used" in message
            ), message
            assert not (body.get("request_id") == winner_id and same_command(body, winner))
    assert api.plane.ledger.running == winner_id and len(api.jobs.queue) == 1
    assert api.cluster.calls == [], "nothing runs before its job does"
    api.jobs.run_all()
    assert [call[2] for call in api.cluster.calls] == [winner_id]
    record = api.client.get(f"{REQUESTS}/{winner_id}").json()
    assert record["state"] == "done" and api.plane.ledger.running is None
    status = api.client.get("/fault_tolerance/status").json()
    assert status["running_request_id"] is None
    assert {tuple(e["removed_ranks"]) for e in status["engines"]} == {
        tuple(sorted(api.cluster.removed))
    }


def test_the_same_apply_sent_eight_times_at_once_acts_once() -> None:
    api = Api()
    api.cluster.kill(2)
    body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [2]}, "request_id": "sd"}
    answers = send_concurrently(api, [body] * 8)
    states = sorted(a.json()["state"] for a in answers)
    assert [a.status_code for a in answers] == [202] * 8
    assert states == ["accepted"] + ["running"] * 7
    api.jobs.run_all()
    again = send_concurrently(api, [body] * 4)
    assert [a.status_code for a in again] == [200] * 4
    assert {a.json()["success"] for a in again} == {True}
    assert [call[2] for call in api.cluster.calls] == ["sd"] and api.jobs.queue == []
    assert {e["epoch"] for e in api.client.get("/fault_tolerance/status").json()["engines"]} == {1}


def test_a_replay_sent_after_the_state_moved_on_still_gets_its_record() -> None:
    """A replay is judged against what was recorded, not against today's cluster: after
    scale_down [2] removed rank 2, replaying it is its 200 record, not a range error."""
    api = Api()
    api.cluster.kill(2)
    body = {"instruction": "scale_down", "params": {"removed_dp_ranks": [2]}, "request_id": "sd"}
    assert api.client.post(APPLY, json=body).status_code == 202
    api.jobs.run_all()
    before = api.state()
    replay = api.client.post(APPLY, json=body)
    assert replay.status_code == 200 and replay.json()["success"] is True
    assert api.state() == before
