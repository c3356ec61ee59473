"""Shared hypothesis strategies: faults, decisions, policy contexts and constant test policies."""

from __future__ import annotations

import attrs
from hypothesis import strategies as st

from ftengine.context import RecoveryContext, RedundancyFacts
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.policies import (
    Composable,
    Decision,
    GiveUp,
    Retry,
    ScaleDown,
    WaitForOrchestrator,
)

WORLD = 4

seconds = st.floats(min_value=0.0, max_value=1e4, allow_nan=False, allow_infinity=False)
times = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)
ranks = st.integers(min_value=0, max_value=WORLD - 1)
rank_sets = st.frozensets(ranks, min_size=1, max_size=WORLD)
fault_kinds = st.sampled_from(FaultKind)


@st.composite
def faults(draw: st.DrawFn, at: float | None = None) -> Fault:
    """A fault of any kind, pointing at a rank of a ``WORLD``-rank cluster (or none)."""
    return Fault(
        kind=draw(fault_kinds),
        rank=draw(st.none() | ranks),
        step=draw(st.none() | st.integers(min_value=0, max_value=1000)),
        info=draw(st.sampled_from(["", "PeerDead", "CollectiveTimeout", "RuntimeError"])),
        at=draw(seconds) if at is None else at,
    )


retries = st.builds(Retry, seconds)
scale_downs = st.builds(ScaleDown, rank_sets)
waits = st.builds(WaitForOrchestrator, times)
give_ups = st.builds(GiveUp, st.sampled_from(["limit", "deadline", "dead rank"]))
decisions: st.SearchStrategy[Decision] = st.one_of(retries, scale_downs, waits, give_ups)


@st.composite
def contexts(draw: st.DrawFn) -> RecoveryContext:
    """A self-consistent policy context: history ends with the fault, now >= every fault."""
    now = draw(st.floats(min_value=0.0, max_value=1e3, allow_nan=False))
    history = draw(st.lists(faults(), max_size=8))
    history = [attrs.evolve(f, at=min(f.at, now)) for f in history]
    fault = draw(faults(at=now))
    removed = draw(st.frozensets(ranks, max_size=WORLD - 1))
    return RecoveryContext(
        fault=fault,
        phase=draw(st.sampled_from([p for p in Phase if p is not Phase.DEAD])),
        now=now,
        episode_start=draw(st.floats(min_value=0.0, max_value=now, allow_nan=False)),
        attempts=draw(st.integers(min_value=0, max_value=10)),
        faults=(*sorted(history, key=lambda f: f.at), fault),
        dead_ranks=draw(st.frozensets(ranks, max_size=WORLD)) - removed,
        removed_ranks=removed,
        rank=draw(ranks),
        world_size=WORLD,
        redundancy=draw(st.none() | st.just(RedundancyFacts(WORLD, 3, 8))),
    )


@attrs.frozen
class Constant(Composable):
    """A test policy that always returns ``decision`` (``None`` abstains)."""

    decision: Decision | None

    def __call__(self, ctx: RecoveryContext, /) -> Decision | None:
        return self.decision


constant_policies = st.builds(Constant, st.none() | decisions)


# -- request bodies for the control API (tests/unit/test_control_fuzz.py, ..._concurrency.py)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
"""Any JSON value (what a careless client or an attacker can send)."""


def json_objects(
    fields: tuple[str, ...], near: tuple[object, ...] = ()
) -> st.SearchStrategy[dict[str, object]]:
    """Objects with some of ``fields`` (the route's own names: deeper checks get reached),
    each holding any JSON value or one of ``near`` (values right for some field), plus
    maybe some unknown fields."""
    values = json_values | st.sampled_from(near) if near else json_values
    known = st.dictionaries(st.sampled_from(fields), values, max_size=len(fields))
    unknown = st.dictionaries(st.text(max_size=8), json_values, max_size=2)
    return st.builds(lambda k, u: {**u, **k}, known, unknown)


def mutations(
    base: dict[str, object], fields: tuple[str, ...], near: tuple[object, ...] = ()
) -> st.SearchStrategy[dict[str, object]]:
    """``base`` (a good body) with up to two of ``fields`` set to any JSON value or one of
    ``near``, or dropped: each field's own check gets reached, one field at a time."""
    values = json_values | st.sampled_from(near) if near else json_values
    changed = st.dictionaries(st.sampled_from(fields), values, max_size=2)
    dropped = st.sets(st.sampled_from(fields), max_size=1)
    return st.builds(
        lambda c, d: {k: v for k, v in {**base, **c}.items() if k not in d}, changed, dropped
    )


APPLY_FIELDS = ("instruction", "params", "request_id")
COMPLETION_FIELDS = (
    "model", "prompt", "max_tokens", "temperature", "n", "stream", "stream_options", "stop",
    "stop_token_ids", "ignore_eos", "logprobs", "echo", "return_token_ids", "request_id",
)  # fmt: skip

commands = st.fixed_dictionaries(
    {"instruction": st.sampled_from(["retry", "scale_down"])},
    optional={"request_id": st.sampled_from(["a", "b", "c"])},
).flatmap(
    lambda body: (
        st.just({**body, "params": {}})
        if body["instruction"] == "retry"
        else st.lists(ranks, min_size=1, max_size=WORLD, unique=True).map(
            lambda chosen: {**body, "params": {"removed_dp_ranks": chosen}}
        )
    )
)
"""Well-shaped apply bodies (retry, or scale_down of 1..4 distinct ranks: all 4 is a 400),
some sharing a request_id."""
