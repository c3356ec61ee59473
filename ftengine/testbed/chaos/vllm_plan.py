"""The real-vLLM campaign's rules, as pure functions of what it saw (unit-tested without
vLLM): which kinds vLLM supports here, the victims of a fault, when the deployment must be
rebuilt first, each kind's detection bound, and what an orchestrator does
next given every engine's ``/fault_tolerance/status`` (retry, scale_down, fence, wait, done).

vLLM-specific limit planned around: an engine stopped by SIGSTOP never reports anything
itself, so the orchestrator fences (SIGKILLs) an engine that has not faulted while its
peers have for longer than a grace period. A step exception after a scale-down is retried
among the survivors, and rank 0 lost with two or more survivors goes on (its parked engine
core keeps the DP coordinator up): neither needs a rebuild."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ftengine.integrations.vllm.engine_core.quorum import HEALS, PARTITION, Sight, keeps_serving
from ftengine.integrations.vllm.engine_core.rejoin import REJOINING_PHASES
from ftengine.integrations.vllm.engine_core.relaunch_state import FAILED_WORDS
from ftengine.testbed.chaos.catalogue import ChaosKind, PlannedFault, When
from ftengine.testbed.chaos.invariants import FaultResult, check_fault
from ftengine.testbed.chaos.recovery import Decision
from ftengine.testbed.chaos.traffic import StreamRecord

if TYPE_CHECKING:  # (hosts.py loads the CPU cluster's package: only a run on hosts needs it)
    from ftengine.testbed.vllm.hosts import HostLayout

VLLM_KINDS = (
    ChaosKind.STEP_RAISE,
    ChaosKind.SIGKILL,
    ChaosKind.SIGSTOP,
    ChaosKind.TWO_RANKS,
    ChaosKind.RANK0,
    ChaosKind.ENGINE_CORE,
    ChaosKind.POISON,
)
"""What vLLM supports here: an injected step exception (``FTENGINE_VLLM_FAULT_FILE``),
SIGKILL / SIGSTOP of one worker, two workers at once, rank 0's worker, SIGKILL of one
engine-core process (not rank 0's: its server would stop, and with it the DP coordinator),
a poison request (``poison.py``). On several hosts (``--hosts``) :data:`HOST_KINDS` adds
the loss of a whole host and a partition."""

HOST_KINDS = (ChaosKind.HOST, ChaosKind.NET_CUT)
"""What a deployment over network-namespace hosts adds: every process of every rank on one
host SIGKILLed at once, and one host cut off from the others (both sides alive; the
deployment's own majority rule, ``quorum.py``, keeps the side with the most live ranks
serving and stops the other); never rank 0's host: it holds vLLM's DP coordinator and
store, which no survivor takes over yet."""

NOT_COVERED = {
    "reload_error": "not injected: vLLM's scale-down reloads experts inside the engine core "
    "with no fault seam to inject a reload error from outside",
    "shard_truncated": "not injected: the scale-down's reload is too short (8 experts, "
    "under 1 MB) to break a shard inside it from outside reliably",
    "shard_removed": "not injected: as shard_truncated",
    "net_cut": "not injected: vLLM's ranks run in the root network namespace here",
}
NOT_COVERED_ON_HOSTS = {k: v for k, v in NOT_COVERED.items() if k != "net_cut"}

DOWN = ("dead", "unreachable")
"""Statuses of an engine that will not serve again (``unreachable``: its server stopped)."""


def victims(
    fault: PlannedFault, live: Sequence[int], layout: HostLayout | None = None
) -> tuple[int, ...]:
    """The ranks ``fault`` hits among ``live``: rank 0 for ``rank0``; any live rank for a
    step exception or a poison request (the rank it is sent to); for ``host`` the live
    ranks of one host of ``layout`` other than rank 0's, for ``net_cut`` those of one such
    host that the other hosts' ranks outvote (``quorum.keeps_serving``: the cut-off side is
    the one that stops); else ranks other than 0 (rank 0's loss is its own kind)."""
    ranks = sorted(live)
    if fault.kind is ChaosKind.RANK0:
        return (0,) if 0 in ranks else ()
    if fault.kind in (ChaosKind.HOST, ChaosKind.NET_CUT):
        return _host_victims(fault, ranks, layout)
    anyone = fault.kind in (ChaosKind.STEP_RAISE, ChaosKind.POISON)
    pool = ranks if anyone else [r for r in ranks if r != 0]
    count = max(1, fault.ranks_lost)
    if len(pool) < count:
        return ()
    start = fault.pick % len(pool)
    return tuple(sorted(pool[(start + i) % len(pool)] for i in range(count)))


def _host_victims(
    fault: PlannedFault, ranks: Sequence[int], layout: HostLayout | None
) -> tuple[int, ...]:
    if layout is None:
        return ()
    hosts = [h for h in range(1, layout.hosts) if set(layout.ranks_on(h)) & set(ranks)]
    if fault.kind is ChaosKind.NET_CUT:
        hosts = [h for h in hosts if _outvoted(layout.ranks_on(h), ranks)]
    if not hosts:
        return ()
    return tuple(r for r in layout.ranks_on(hosts[fault.pick % len(hosts)]) if r in ranks)


def _outvoted(cut: Sequence[int], live: Sequence[int]) -> bool:
    """Whether the live ranks outside ``cut`` keep serving once cut off from it."""
    rest = [r for r in live if r not in cut]
    return bool(rest) and keeps_serving(Sight(min(rest), members=live, reaches=rest))


def cut_hosts(hit: Sequence[int], layout: HostLayout) -> tuple[list[int], list[int]]:
    """The two sides (hosts) of a ``net_cut`` that cuts off the host of ``hit``."""
    cut = layout.host_of(hit[0])
    return [h for h in range(layout.hosts) if h != cut], [cut]


def follows(
    fault: PlannedFault,
    follow: PlannedFault | None,
    live: Sequence[int],
    layout: HostLayout | None = None,
) -> bool:
    """Whether ``follow`` lands during ``fault``'s recovery: planned so, a SIGKILL (the one
    recovery-phase fault injected here: a survivor's worker killed right after the first
    command), and a survivor other than rank 0 left for it with one rank beyond."""
    if follow is None or follow.when is not When.RECOVERY or follow.kind is not ChaosKind.SIGKILL:
        return False
    hit = set(victims(fault, live, layout)) if fault.ranks_lost else set()
    rest = [r for r in live if r not in hit]
    return len(rest) >= 2 and any(r != 0 for r in rest)


def rebuild_first(
    fault: PlannedFault,
    live: Sequence[int],
    extra_lost: int = 0,
    layout: HostLayout | None = None,
) -> str | None:
    """Why the deployment must be rebuilt before ``fault`` (None: it can run now)."""
    # A step exception may come after a scale-down too: the retry rebuilds among the
    # survivors (``scale_down.reinit_for_retry``).
    hit = victims(fault, live, layout)
    if not hit:
        return f"no victim for {fault.kind.value} among live ranks {list(live)}"
    lost = len(hit) if fault.kind in (ChaosKind.HOST, ChaosKind.NET_CUT) else fault.ranks_lost
    if len(live) - lost - extra_lost < 1:
        return f"{len(live)} ranks left, {fault.kind.value} takes {lost + extra_lost}"
    return None


def detection_bound(kind: ChaosKind, op_timeout_s: float) -> float:
    """Seconds within which every peer must see ``kind``: the op timeout + 1 s when peers
    learn of it only through their collective's op timeout (a stopped worker, and an
    injected step exception or poison request: it closes no socket, and the agents give no
    early report for a peer that is only ``unhealthy``), or through silence (a cut link:
    ``quorum.SILENT_S``, or the op timeout of a step waiting across the cut); the op
    timeout for a killed worker."""
    if kind in (ChaosKind.SIGSTOP, ChaosKind.STEP_RAISE, ChaosKind.POISON, ChaosKind.NET_CUT):
        return op_timeout_s + 1.0
    return op_timeout_s


def detectors(
    kind: ChaosKind, live: Sequence[int], hit: Sequence[int], when: When = When.STEADY
) -> tuple[int, ...]:
    """The ranks whose status must change for the fault to count as detected: all live
    ranks, except a stopped victim (it cannot report until it is fenced); for a fault during
    recovery only its victims (their peers are faulted already: the victims must go dead)."""
    if when is When.RECOVERY:
        return tuple(hit)
    if kind is ChaosKind.SIGSTOP:
        return tuple(r for r in live if r not in hit)
    return tuple(live)


def removed_ranks(engines: Mapping[int, Mapping[str, Any]]) -> set[int]:
    """The ranks the serving engines report as removed by a scale-down."""
    found: set[int] = set()
    for engine in engines.values():
        if engine.get("status") not in DOWN:
            found.update(int(r) for r in engine.get("removed_ranks") or ())
    return found


def decide(
    engines: Mapping[int, Mapping[str, Any]],
    may_die: Sequence[int],
    faulted_for_s: float,
    grace_s: float,
) -> Decision:
    """The next step of an orchestrator that sees ``engines`` (rank -> status), where only
    ``may_die`` may end dead and some engine has been ``unhealthy`` for ``faulted_for_s``."""
    removed = removed_ranks(engines)
    # A rank rejoining (rank 0 relaunching its worker in place, or a restarted one) is no
    # member until admitted, and one a partition's minority side holds is stopping: down for
    # the decision, never a rank to command.
    live = {
        r: "dead" if e.get("phase") in REJOINING_PHASES or stopping(e) else str(e.get("status"))
        for r, e in engines.items()
        if r not in removed
    }
    down = {r for r, s in live.items() if s in DOWN}
    sick = tuple(sorted(r for r, s in live.items() if s == "unhealthy"))
    well = tuple(sorted(r for r, s in live.items() if s == "healthy"))
    if not sick:
        if not well or down - set(may_die):
            return Decision("done", state="dead")
        return Decision("wait") if down else Decision("done", state="settled")
    if well:  # a peer that has not faulted although others did: hung, once the grace is over
        return Decision("fence", targets=well) if faulted_for_s > grace_s else Decision("wait")
    if down:
        ranks = sorted(removed | down)
        return Decision("command", sick, "scale_down", {"removed_dp_ranks": ranks})
    return Decision("command", sick, "retry")


def stopping(engine: Mapping[str, Any]) -> bool:
    """An engine on a partition's minority side: ``unhealthy``, saying so in its
    ``fault_info`` (``quorum.PARTITION``), and ``dead`` as soon as it is idle: a retry that
    counts it waits for it in vain (vLLM's 30 s for every client)."""
    return engine.get("status") == "unhealthy" and PARTITION in str(engine.get("fault_info"))


def relaunches_in_place(rank: int, engine: Mapping[str, Any]) -> bool:
    """Whether removed rank ``rank`` comes back through its own engine core, its server
    never restarted: DP rank 0 (it relaunches its worker in place) and a partition's
    minority parked for the link (``quorum.HEALS`` in its reason, or already relaunching
    once it saw the link back). A minority that could not be parked (its status does not
    say it rejoins) exits at vLLM's deadline instead and is restarted."""
    return (
        rank == 0
        or engine.get("phase") in REJOINING_PHASES
        or (engine.get("status") == "dead" and HEALS in str(engine.get("fault_info")))
    )


def relaunch_failed(engine: Mapping[str, Any]) -> bool:
    """DP rank 0's relaunch of its worker in place failed (``relaunch_state.FAILED_WORDS``
    in its ``fault_info``): it will not be ``ready`` without a restart of its server, so a
    heal waiting for it gives up at once (the loop rebuilds) rather than at its deadline."""
    return engine.get("status") == "dead" and FAILED_WORDS in str(engine.get("fault_info"))


def as_dead(engine: dict[str, Any]) -> dict[str, Any]:
    """An engine whose server stopped answering is dead, with that as its reason; so is one
    rejoining (rank 0 relaunched in place, ``ready`` before the fault's outcome): no member
    until the heal admits it."""
    if engine.get("status") == "unreachable" or engine.get("phase") in REJOINING_PHASES:
        return {**engine, "status": "dead"}
    return engine


def judge(result: FaultResult, op_timeout_s: float) -> list[str]:
    """The cluster campaign's per-fault invariants (``check_fault``), with vLLM's detection
    bounds (``vllm_plan.detection_bound``) in place of the cluster's."""
    problems = [p for p in check_fault(result, op_timeout_s) if not p.startswith("detection:")]
    bound = detection_bound(result.kind, op_timeout_s)
    if result.detect_s is None and result.when is When.STEADY:
        problems.insert(0, f"detection: not detected (bound {bound:.1f} s)")
    elif result.detect_s is not None and result.detect_s > bound:
        problems.insert(0, f"detection: {result.detect_s:.3f} s > bound {bound:.1f} s")
    return problems


def coalesced(record: StreamRecord, problems: list[str]) -> bool:
    """A completed stream whose only problem is a chunk of several tokens, the tokens all
    there in order: vLLM's ``RequestOutputCollector`` merges a request's deltas when the
    engine gets ahead of the API server's consumer (a loaded machine), which is no gap and
    no repeat (``wrong_tokens`` checks the whole sequence)."""
    names = {p.split(":", 1)[0] for p in problems}
    done = record.finish_reason == "length" and record.error is None
    return done and names == {"stream_gaps_or_repeats"}
