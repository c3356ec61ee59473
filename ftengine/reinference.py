"""Token-level re-inference, the semantics written once (the second seed): a request's state
is its prompt plus the tokens already emitted, a fault never discards it, and after recovery
it continues from its last emitted token, recomputing what its KV cache lost.

Device-agnostic value logic only: :class:`TokenLedger` says what to feed a request next and
what an output means (a new token, or the replay of one already emitted);
:class:`Reinference` holds the bounds (re-runs, the recovery deadline) and the reasons a
held request ends with; :class:`PoisonProbe` re-runs the requests of a faulted rank one at a
time, so a request whose own content faults every re-run is found and ends alone. The
CPU cluster's serving loop uses them (``ftengine.testbed.cluster.inflight``); a vLLM engine core
could drive the same objects.
"""

from __future__ import annotations

from collections.abc import Collection

import attrs

from ftengine.errors import FTEngineError

DEFAULT_MAX_REINFERENCE = 3  # the seed's max_reinference_times


class ReplayMismatch(FTEngineError, RuntimeError):
    """A replayed step predicted a token other than the one already emitted (the model is
    not deterministic): resuming would change the client's text, so the request ends."""


@attrs.frozen
class Reinference:
    """How held requests are bounded: at most ``max_reruns`` re-runs of a faulted step per
    request, and never held longer than ``deadline_s`` seconds waiting for recovery."""

    max_reruns: int = attrs.field(default=DEFAULT_MAX_REINFERENCE, validator=attrs.validators.ge(0))
    deadline_s: float = attrs.field(default=120.0, validator=attrs.validators.gt(0))

    def over_limit(self, reruns: int) -> str | None:
        """The abort message once a request needs its ``reruns``-th re-run, past the limit."""
        if reruns <= self.max_reruns:
            return None
        return (
            f"re-inference limit reached: the request was in {reruns} faulted steps and may "
            f"be re-run at most {self.max_reruns} times (max_reinference)"
        )

    def expired(self, held_s: float) -> str | None:
        """The abort message once requests have been held ``held_s`` seconds, past the
        deadline; None while they may still wait."""
        if held_s <= self.deadline_s:
            return None
        return (
            f"held {held_s:.1f}s for a recovery that did not finish within the "
            f"{self.deadline_s:g}s recovery deadline (recovery_timeout)"
        )

    @staticmethod
    def dead(reason: str) -> str:
        """The abort message when recovery ended DEAD."""
        return f"recovery ended DEAD, the held request cannot resume: {reason}"

    @staticmethod
    def off(fault: str) -> str:
        """The abort message of a request in flight at a fault while re-inference is off."""
        return f"{fault}; re-inference is off (ftengine.reinference), the request is aborted"

    @staticmethod
    def poison(rank: int) -> str:
        """The error message of a request found to fault every re-run by itself."""
        return (
            f"poison request: re-run alone on rank {rank} after a fault, it faulted again "
            "(its own content faults the step); its batch-mates continue"
        )


@attrs.define
class TokenLedger:
    """One request's token state: ``prompt`` + ``emitted``, of which the first ``computed``
    tokens are in its KV cache (the cache holds prompt + emitted[:-1] while decoding).

    Feed :meth:`next_input`, then give the step's token to :meth:`accept`; a faulted step
    leaves ``computed`` as it was (its KV is dropped), a lost cache resets it to 0 and the
    request is replayed token by token through the same shapes it first ran with, so the
    replay is bit-exact and its predictions are checked against ``emitted``.
    """

    prompt: tuple[int, ...]
    emitted: list[int] = attrs.field(factory=list)
    computed: int = 0
    reruns: int = 0
    _fed: int = 0

    def next_input(self) -> tuple[int, tuple[int, ...]]:
        """``(start, tokens)``: the cache must hold ``start`` tokens; feed ``tokens``."""
        if self.computed == 0:
            self._fed = len(self.prompt)
            return 0, self.prompt
        self._fed = 1
        return self.computed, (self._sequence(self.computed),)

    @property
    def replaying(self) -> bool:
        """True while the next step recomputes tokens already emitted."""
        return self.computed + (len(self.prompt) if self.computed == 0 else 1) < self.length

    @property
    def length(self) -> int:
        """Prompt plus emitted tokens."""
        return len(self.prompt) + len(self.emitted)

    def accept(self, token: int) -> int | None:
        """Take the step's predicted token: the new token to emit, or None when the step
        only replayed an emitted one. Raises ReplayMismatch when a replay disagrees."""
        self.computed += self._fed
        if self.computed < self.length:
            expected = self._sequence(self.computed)
            if token != expected:
                raise ReplayMismatch(
                    f"replay at position {self.computed} predicted token {token}, but "
                    f"{expected} was already emitted"
                )
            return None
        self.emitted.append(token)
        return token

    def faulted(self) -> None:
        """The step this request was in failed: its KV is dropped, the step is re-run."""
        self.reruns += 1

    def cache_lost(self) -> None:
        """Its KV cache is gone (its rank died, or the cache cannot be trusted): replay."""
        self.computed = 0

    def _sequence(self, position: int) -> int:
        if position < len(self.prompt):
            return self.prompt[position]
        return self.emitted[position - len(self.prompt)]


@attrs.define
class PoisonProbe:
    """The requests a faulted step's failing rank held, re-run one at a time.

    While ``suspects`` is not empty only :meth:`probe` of them runs in a step (the others
    wait); a clean step clears it. If a lone probe's step faults on its rank again, it is
    the poison request. A fault with no rank to blame (a process died) suspects nobody.
    """

    suspects: list[str] = attrs.field(factory=list)

    def suspect(self, request_ids: list[str]) -> None:
        """A step faulted on the rank holding ``request_ids``: re-run them one at a time."""
        self.suspects = [rid for rid in request_ids if rid not in self.suspects] + [
            rid for rid in self.suspects if rid not in request_ids
        ]

    def probe(self) -> str | None:
        """The one suspect to run in the next step (None: nobody is suspected)."""
        return self.suspects[0] if self.suspects else None

    def waits(self, request_id: str) -> bool:
        """True if ``request_id`` is suspected but not this step's probe (it is held)."""
        return request_id in self.suspects[1:]

    def cleared(self, request_id: str) -> None:
        """``request_id`` ran a clean step, or ended: it is no longer suspected."""
        if request_id in self.suspects:
            self.suspects.remove(request_id)

    def culprit(self, ran: Collection[str], clean: Collection[str]) -> str | None:
        """The poison request, if a step that faulted on one rank is the probe's: the probe
        ran there (``ran``: that rank's requests in the step) and every other one had run
        clean steps without it since the fault (``clean``). None: the fault may be anyone's."""
        probe = self.probe()
        if probe is None or probe not in ran:
            return None
        return probe if all(rid in clean for rid in ran if rid != probe) else None
