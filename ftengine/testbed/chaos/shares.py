"""What each fault kind cost, beside the invariants (issue 30): the share of its faults
whose recovery ended DEAD (the deployment could not recover), and why, and the share of the
requests it touched that were answered. A request is counted against the fault injected
last before it ended (as its problems are blamed); one that ended before the first fault
counts under ``"none"``. A request the minority side of a partition ended or refused, naming
the partition (``quorum.PARTITION``), was asked on the side that must stop: it counts in
``minority_ended``, not in the shares (issue 30: answered "outside the minority side")."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

from ftengine.integrations.vllm.engine_core.quorum import PARTITION
from ftengine.testbed.chaos.catalogue import Injected
from ftengine.testbed.chaos.invariants import FaultResult, answered, fault_at
from ftengine.testbed.chaos.traffic import StreamRecord

NO_FAULT = "none"
REASON_CHARS = 120  # a DEAD reason is grouped by its first characters (ids and times vary)


def dead_reasons(result: FaultResult) -> list[str]:
    """Why the engines are ``dead`` after a fault whose recovery ended DEAD (their
    ``ft_error``, else their ``fault_info``), shortened; the victims of a kill are dead by
    design and not counted. None for a fault that settled (ranks an earlier fault removed
    are still ``dead`` then: not this fault's doing)."""
    if result.outcome != "dead":
        return []
    reasons = []
    for engine in result.engines:
        if engine.get("status") != "dead" or engine.get("id") in result.victims:
            continue
        why = str(engine.get("ft_error") or engine.get("fault_info") or "no reason given")
        reasons.append(why.splitlines()[0][:REASON_CHARS])
    return reasons


def minority_side(record: StreamRecord) -> bool:
    """Not answered, and ended or refused by a partition's minority side, which said so."""
    return not answered(record) and PARTITION in f"{record.stop_reason} {record.error}"


def _share(part: int, whole: int) -> float | None:
    return None if whole == 0 else round(part / whole, 4)


def by_kind_shares(
    results: Sequence[FaultResult],
    records: Sequence[StreamRecord],
    injections: Sequence[Injected],
) -> dict[str, dict[str, Any]]:
    """Per fault kind: ``faults``, ``dead`` (faults whose recovery ended DEAD),
    ``dead_share``, ``dead_reasons`` (reason: count), ``requests`` (those counted
    against a fault of the kind, but those ``minority_ended``), ``answered`` and
    ``answered_share``."""
    shots = sorted(injections, key=lambda shot: shot.at)
    starts, indices = [s.at for s in shots], [s.fault.index for s in shots]
    kind_of = {s.fault.index: s.fault.kind.value for s in shots}
    rows: dict[str, dict[str, Any]] = collections.defaultdict(
        lambda: {
            "faults": 0,
            "dead": 0,
            "reasons": collections.Counter(),
            "requests": 0,
            "answered": 0,
            "minority_ended": 0,
        }
    )
    for result in results:
        row = rows[result.kind.value]
        row["faults"] += 1
        if result.outcome == "dead":
            row["dead"] += 1
            row["reasons"].update(set(dead_reasons(result)) or {"no engine but the victims"})
    for record in records:
        ended = record.ended if record.ended is not None else record.started
        blamed = fault_at(starts, indices, ended)
        row = rows[NO_FAULT if blamed is None else kind_of[blamed]]
        if minority_side(record):
            row["minority_ended"] += 1
            continue
        row["requests"] += 1
        row["answered"] += answered(record)
    return {
        kind: {
            "faults": row["faults"],
            "dead": row["dead"],
            "dead_share": _share(row["dead"], row["faults"]),
            "dead_reasons": dict(row["reasons"].most_common()),
            "requests": row["requests"],
            "answered": row["answered"],
            "answered_share": _share(row["answered"], row["requests"]),
            "minority_ended": row["minority_ended"],
        }
        for kind, row in sorted(rows.items())
    }


def unanswered_reasons(records: Sequence[StreamRecord]) -> dict[str, int]:
    """Why the requests not answered were not, most common first: each one's ``stop_reason``
    (an abort's, a stream's error event's), else its client's error, else how it ended,
    shortened to :data:`REASON_CHARS` (the lines' ids and times vary after that)."""
    reasons: collections.Counter[str] = collections.Counter()
    for record in records:
        if answered(record):
            continue
        why = record.stop_reason or record.error or f"ended {record.finish_reason!r}"
        reasons[str(why).splitlines()[0][:REASON_CHARS]] += 1
    return dict(reasons.most_common())


def answered_share(records: Sequence[StreamRecord]) -> float | None:
    """Requests answered over all requests asked outside a partition's minority side, the
    whole run."""
    asked = [r for r in records if not minority_side(r)]
    return _share(sum(answered(r) for r in asked), len(asked))
