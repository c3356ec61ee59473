"""Admitting restarted ranks as an orchestrator does over vLLM's HTTP API: ``scale_up`` to
every survivor and to each returning rank (with the survivors' ``dp_store``), then every
rank's status read until they all serve. An admission that a rank answers as failed (a
survivor's recovery rebuilt the DP group at a new store after the bodies were built, say)
is sent again with the survivors' status of then, as the failure's own reason asks."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from ftengine.errors import FTEngineError
from ftengine.integrations.vllm.scale_up_bodies import scale_up_bodies

APPLY_PATH = "/fault_tolerance/apply"
STATUS_PATH = "/fault_tolerance/status"
ATTEMPTS = 3
POLL_S = 0.2


class AdmissionFailed(FTEngineError, RuntimeError):
    """The ranks were not admitted: every attempt's failure, or the statuses at the deadline."""


def own_status(http: httpx.Client, url: str, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s engine as its own server reports it (``unreachable``: no answer)."""
    try:
        engines = http.get(f"{url}{STATUS_PATH}").json()["engines"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return {"id": rank, "status": "unreachable", "ft_error": f"{type(exc).__name__}: {exc}"}
    for engine in engines:
        if int(engine["id"]) == rank:
            return dict(engine)
    return {"id": rank, "status": "unreachable", "ft_error": f"rank {rank} not in {engines}"}


def send_scale_up(
    http: httpx.Client, urls: Sequence[str], added: Sequence[int], survivors: Sequence[int]
) -> dict[int, httpx.Response]:
    """``scale_up`` to every survivor and to each rank of ``added`` (with the survivors' DP
    store, read from the first survivor's status), all sent before any is answered (vLLM
    answers 202 and runs the command in the background); each rank's response."""
    status = http.get(f"{urls[survivors[0]]}{STATUS_PATH}").json()
    to_survivor, to_returning = scale_up_bodies(added, status)
    sent = {r: to_survivor for r in survivors} | {r: to_returning for r in added}
    return {rank: http.post(f"{urls[rank]}{APPLY_PATH}", json=body) for rank, body in sent.items()}


def serving(engine: Mapping[str, Any], added: Sequence[int]) -> bool:
    """Healthy, with none of ``added`` removed any more."""
    removed = engine.get("removed_ranks") or []
    return engine.get("status") == "healthy" and not set(added) & {int(r) for r in removed}


def admit(
    urls: Sequence[str],
    added: Sequence[int],
    survivors: Sequence[int],
    timeout_s: float,
    attempts: int = ATTEMPTS,
    progress: Callable[[str], None] | None = None,
    http: httpx.Client | None = None,
) -> dict[int, dict[str, Any]]:
    """Admit ``added`` (each ``ready``) into ``survivors``; every rank's status once all
    serve. Each attempt starts once every survivor is healthy; a rank that answers the
    attempt's command as failed starts the next; :class:`AdmissionFailed` after
    ``attempts`` failures or at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    ranks = [*survivors, *added]
    failures: list[dict[int, str]] = []
    with http or httpx.Client(timeout=30.0) as http:

        def statuses() -> dict[int, dict[str, Any]]:
            return {r: own_status(http, urls[r], r) for r in ranks}

        def overdue(what: str, found: Mapping[int, object]) -> AdmissionFailed:
            return AdmissionFailed(
                f"ranks {list(added)} not admitted within {timeout_s:.0f} s ({what}); "
                f"failed attempts: {failures}; statuses: {dict(found)}"
            )

        for attempt in range(1, attempts + 1):
            while not all(
                own_status(http, urls[r], r).get("status") == "healthy" for r in survivors
            ):
                if time.monotonic() > deadline:
                    raise overdue("survivors not healthy", statuses())
                time.sleep(POLL_S)
            answers = send_scale_up(http, urls, added, survivors)
            if any(a.status_code != 202 for a in answers.values()):
                raise AdmissionFailed(
                    f"scale_up of ranks {list(added)} answered "
                    f"{ {r: (a.status_code, a.text) for r, a in answers.items()} }"
                )
            ids = {str(a.json()["request_id"]) for a in answers.values()}
            while True:
                found = statuses()
                if all(serving(e, added) for e in found.values()):
                    return found
                failed = {
                    r: str(e.get("ft_error"))
                    for r, e in found.items()
                    if e.get("last_ft_request_id") in ids
                }
                if failed:
                    failures.append(failed)
                    if progress is not None:
                        progress(f"admission attempt {attempt} of {attempts} failed: {failed}")
                    break
                if time.monotonic() > deadline:
                    raise overdue(f"attempt {attempt} under way", found)
                time.sleep(POLL_S)
    raise AdmissionFailed(f"ranks {list(added)} not admitted in {attempts} attempts: {failures}")
