"""A refusal before admission: a server that answers 503 before any token did not take the
request (the cluster is recovering, or this rank is DEAD) and says when to ask again
(``Retry-After``). The official ``openai`` client retries such an answer by default, and a
load balancer sends it to another server; the test bed's clients do the same, within their
own time budget, so a refused request is one the user asked once, not a lost one."""

from __future__ import annotations

from collections.abc import Mapping

RETRY_AFTER_CAP_S = 1.0
"""The longest a refused client waits before asking again (the servers say 1 s)."""


def retry_after_s(headers: Mapping[str, str]) -> float:
    """How long to wait before asking again: the answer's ``Retry-After`` seconds (1 when
    absent or not a number of seconds), at most :data:`RETRY_AFTER_CAP_S`."""
    try:
        wait = float(headers.get("Retry-After", 1))
    except ValueError:  # an HTTP date: ask again at the cap
        wait = RETRY_AFTER_CAP_S
    return max(0.0, min(wait, RETRY_AFTER_CAP_S))
