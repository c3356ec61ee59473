"""``scale_up`` in vLLM's engine core: the survivors admit a restarted rank at a common step
boundary, while their requests keep running (issue 28).

vLLM dispatches a fault-tolerance command only to an UNHEALTHY engine; a survivor that admits
a rank is HEALTHY and serving, and the returning rank (``engine_core/rejoin.py``) is idle and
alone. So ``EngineCoreSentinel.handle_command`` hands ``scale_up`` here (vLLM's input thread)
and answers with vLLM's own ``FaultToleranceResult`` once the admission is done.

- **The returning rank** (its ``params`` hold ``dp_store``, the survivors' current DP store
  ``host:port``, from a survivor's ``/fault_tolerance/status``): its busy loop, between two
  steps, writes ``ft_join_<rank>`` on that store, waits for the lowest survivor's
  ``ft_admit_<rank>`` (the epoch, the removed set, the wave, the worker's epoch), joins the
  new DP group at its dense rank, and relays the command to its worker (whose FSM goes
  ready -> joining -> healthy). Its rejoin flag is cleared: its server serves.
- **Each survivor**: the command marks an admission pending and wakes the busy loop; vLLM's
  DP-state sync (``DPEngineCoreProc._has_global_unfinished_reqs``, on the same step of every
  member) then all-reduces one more count: members whose admission is pending and whose
  returning ranks have written their join key. All of them -> every member admits right
  there, after the same step (the group rebuilt with the returning ranks at a fresh epoch,
  the command relayed to the worker, which un-masks, takes its experts back and runs a dummy
  batch with the new member); some -> everyone keeps stepping (dummy batches when idle)
  until the next sync, as vLLM's own pause consensus does; none -> vLLM's answer. Requests
  in flight stay in the scheduler throughout: nothing is aborted or re-run.

Every survivor must get the command (as for ``retry`` / ``scale_down``); one that does not
leaves the others stepping until their command's deadline, then they answer why.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import attrs
import torch

from ftengine.commands import ADDED_KEY, EPOCH_KEY, REMOVED_KEY, parse_command
from ftengine.context import AdmissionContext
from ftengine.errors import CommandRejected, FTEngineError
from ftengine.integrations.vllm.engine_core.scale_down import AGENT_ATTR as AGENT_ATTR
from ftengine.integrations.vllm.engine_core.scale_down import (
    EPOCH_ATTR,
    REMOVED_ATTR,
    STORE_ATTR,
    WAVE_LEAD_ATTR,
    reinit_dp_group,
)
from ftengine.integrations.vllm.messages import import_vllm
from ftengine.integrations.vllm.rejoin_flag import REJOIN_KEY, rejoining
from ftengine.policies import decide_admission

logger = logging.getLogger(__name__)

INSTRUCTION = "scale_up"
ADMIT_MARK = "ftengine-admission"
"""Request type of the input-queue marker that wakes the busy loop for an admission."""
DP_STORE_KEY = "dp_store"
"""``scale_up`` param of the returning rank: the survivors' DP store, ``host:port``."""
ADMISSION_ATTR = "_ftengine_admission"
UTILS_MODULE = "vllm.v1.fault_tolerance.utils"
ENGINE_MODULE = "vllm.v1.engine"
SERIAL_MODULE = "vllm.v1.serial_utils"
DEFAULT_WAIT_S = 60.0
POLICY_REQUEST = "policy"
"""Request-id prefix of an admission the policy decided (no command to answer)."""


def policy_request_id() -> str:
    """A fresh request id for a policy's admission (the worker's FSM ignores a replayed one)."""
    return f"{POLICY_REQUEST}-{uuid.uuid4()}"


def join_key(rank: int) -> str:
    return f"ft_join_{rank}"


def admit_key(rank: int) -> str:
    return f"ft_admit_{rank}"


@attrs.define
class Admission:
    """One ``scale_up`` under way on this engine (``store``: the returning rank's only)."""

    added: frozenset[int]
    request_id: str
    store: tuple[str, int] | None = None
    done: concurrent.futures.Future[Any] = attrs.field(factory=concurrent.futures.Future)
    claimed: bool = False
    cancelled: bool = False
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def claim(self) -> bool:
        """Take it for this sync (the busy loop); False once cancelled or done."""
        with self.lock:
            if self.cancelled or self.done.done():
                return False
            self.claimed = True
            return True

    def unclaim(self) -> None:
        with self.lock:
            self.claimed = False

    def cancel(self) -> bool:
        """Give up waiting (the input thread); False if the busy loop is admitting now."""
        with self.lock:
            if self.claimed:
                return False
            self.cancelled = True
            return True

    def end(self, reason: str) -> bool:
        """End it unstarted, answered with ``reason`` (a fault, or the same command sent
        again); False if the busy loop is admitting now. True if it had ended already."""
        with self.lock:
            if self.done.done():
                return True
            if self.claimed:
                return False
            self.cancelled = True
            self.done.set_exception(NotAdmitted(reason))
            return True


def parse_store(value: object) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; ``CommandRejected`` saying what was expected."""
    host, _, port = str(value).rpartition(":")
    if not isinstance(value, str) or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CommandRejected(
            f"{DP_STORE_KEY} must be the survivors' DP store as 'host:port' (the "
            f"'{DP_STORE_KEY}' of a survivor's /fault_tolerance/status), got {value!r}"
        )
    return host, int(port)


def problems(sentinel: Any, params: dict[str, Any]) -> tuple[Admission | None, list[str]]:
    """The admission a ``scale_up`` asks of this engine, or every reason it refuses."""
    parallel = sentinel.engine.vllm_config.parallel_config
    rank, world = int(parallel.data_parallel_rank), int(parallel.data_parallel_size)
    params = dict(params)
    raw_store = params.pop(DP_STORE_KEY, None)
    try:
        command = parse_command(INSTRUCTION, params)
        store = parse_store(raw_store) if raw_store is not None else None
    except CommandRejected as exc:
        return None, [str(exc)]
    added = frozenset(command.added)
    found = []
    if not added:
        found.append(f"{ADDED_KEY} is empty: name the removed DP ranks to admit")
    if len(added) != len(command.added):
        found.append(f"{ADDED_KEY} names a rank more than once")
    unknown = sorted(added - frozenset(range(world)))
    if unknown:
        found.append(f"ranks {unknown} are not DP ranks 0..{world - 1}")
    from ftengine.integrations.vllm.engine_core.relaunch_state import relaunch_status

    relaunching = relaunch_status(sentinel.engine)
    if relaunching:
        found.append(f"engine {rank} is {relaunching['status']} (phase "
                     f"{relaunching['phase']}): {relaunching['fault_info']}; send scale_up "
                     "once its status shows phase ready")  # fmt: skip
    elif rejoining(parallel):
        if rank not in added:
            found.append(f"this engine (DP rank {rank}) waits to be admitted; "
                         f"{ADDED_KEY} {sorted(added)} does not name it")  # fmt: skip
        if store is None:
            found.append(
                f"a returning rank needs '{DP_STORE_KEY}': the survivors' DP store "
                "('host:port', from a survivor's /fault_tolerance/status)"
            )
    else:
        removed = frozenset(getattr(sentinel, REMOVED_ATTR, frozenset()))
        status = sentinel.status_type.name
        if status != "HEALTHY":
            found.append(f"engine {rank} status is {status}; a survivor admits while HEALTHY")
        not_removed = sorted(added - removed - frozenset(unknown))
        if not_removed:
            found.append(f"ranks {not_removed} are not removed (removed: {sorted(removed)})")
        if command.known_removed is not None and command.known_removed != removed:
            found.append(f"{REMOVED_KEY} {sorted(command.known_removed)} is not this "
                         f"engine's removed set {sorted(removed)}")  # fmt: skip
        epoch = int(getattr(sentinel, EPOCH_ATTR, 0))
        if command.epoch is not None and command.epoch != epoch:
            found.append(f"{EPOCH_KEY} {command.epoch} is not this engine's epoch {epoch}")
        if getattr(sentinel, STORE_ATTR, None) is None:
            found.append(f"engine {rank} has no DP store of its own to admit ranks on")
    pending = getattr(sentinel, ADMISSION_ATTR, None)
    # A returning rank's own join under way (its announcer's, or an earlier command's) is
    # the same admission whatever other ranks a command names: replaced, or answered with.
    if pending is not None and pending.added != added and not rejoining(parallel):
        found.append(f"engine {rank} is already admitting ranks {sorted(pending.added)}; wait "
                     "for that command")  # fmt: skip
    if found:
        return None, found
    return Admission(added, "", store), []


def handle_scale_up(sentinel: Any, client_idx: int, call_id: int, ft_args: dict[str, Any]) -> None:
    """vLLM's input thread: start a ``scale_up`` and return (the input thread keeps taking
    requests); a thread of its own answers it, as vLLM answers a command (a
    ``FaultToleranceResult`` in a utility output), once the admission ends. The same
    command sent again replaces one that has not started (its answer says so): an
    orchestrator re-sends after the survivors' DP store changed."""
    utils = import_vllm(UTILS_MODULE)
    ft_request = utils.FaultToleranceRequest(**ft_args)
    rank = sentinel.engine_index
    admission, found = problems(sentinel, dict(ft_request.params))
    pending = getattr(sentinel, ADMISSION_ATTR, None)
    replaced = f"replaced by scale_up request {ft_request.request_id}"
    if admission is not None and pending is not None and not pending.end(replaced):
        _answer_when_done(sentinel, pending, client_idx, call_id, ft_request.request_id)
        return  # the same ranks are being admitted right now: answer with that outcome
    if admission is None:
        refused = f"[FT] Rejecting {INSTRUCTION} on engine {rank}: " + "; ".join(found)
        logger.warning(refused)
        _answer(sentinel, client_idx, call_id, ft_request.request_id, False, refused)
        return
    admission.request_id = ft_request.request_id
    setattr(sentinel, ADMISSION_ATTR, admission)
    logger.info("[FT] engine %d: admitting DP ranks %s", rank, sorted(admission.added))
    wake(sentinel)
    _answer_when_done(sentinel, admission, client_idx, call_id, ft_request.request_id)


def refuse_while_rejoining(
    sentinel: Any, client_idx: int, call_id: int, ft_args: dict[str, Any]
) -> bool:
    """vLLM's input thread, a command other than ``scale_up``: refused, saying why, while
    this engine rejoins (DP rank 0 relaunching its worker in place, or ready and waiting to
    be admitted: vLLM would judge it on a status of DEAD or HEALTHY that says neither);
    False (vLLM decides) otherwise."""
    parallel = sentinel.engine.vllm_config.parallel_config
    from ftengine.integrations.vllm.engine_core.relaunch_state import relaunch_status

    relaunching = relaunch_status(sentinel.engine)
    if not relaunching and not rejoining(parallel):
        return False
    phase = relaunching.get("phase", "ready")
    instruction = str(ft_args.get("instruction"))
    reason = (
        f"[FT] Rejecting {instruction} on engine {sentinel.engine_index}: it is rejoining "
        f"(phase {phase}); it takes no {instruction} before scale_up admits it"
    )
    logger.warning(reason)
    request_id = str(ft_args.get("request_id") or "")
    _answer(sentinel, client_idx, call_id, request_id, False, reason)
    return True


def _answer_when_done(
    sentinel: Any, admission: Admission, client_idx: int, call_id: int, request_id: str
) -> None:
    threading.Thread(
        target=_await_answer,
        args=(sentinel, admission, client_idx, call_id, request_id),
        name=f"ftengine-scale-up-{request_id}",
        daemon=True,
    ).start()


def _await_answer(
    sentinel: Any, admission: Admission, client_idx: int, call_id: int, request_id: str
) -> None:
    rank = sentinel.engine_index
    wait_s = _wait_s(sentinel)
    reason: str | None = None
    try:
        admission.done.result(timeout=wait_s)
    except concurrent.futures.TimeoutError:
        if admission.cancel():
            reason = (
                f"[FT] engine {rank}: the admission of DP ranks {sorted(admission.added)} did "
                f"not start within {wait_s:.0f} s: every survivor needs the scale_up command, "
                "and the returning ranks theirs (with 'dp_store')"
            )
        else:  # the busy loop is admitting now: its group timeout bounds it
            reason = _failure(admission.done)
    except Exception as exc:
        reason = f"[FT] engine {rank}: the admission failed: {exc}"
    finally:
        if getattr(sentinel, ADMISSION_ATTR, None) is admission:
            setattr(sentinel, ADMISSION_ATTR, None)
    if reason is not None:
        logger.warning("%s", reason)
    _answer(sentinel, client_idx, call_id, request_id, reason is None, reason)


def end_on_fault(sentinel: Any, exc: BaseException) -> None:
    """A fault on an engine whose admission has not started ends it: the recovery rebuilds
    the DP group at a new store, so the returning rank must be sent the new one."""
    admission = getattr(sentinel, ADMISSION_ATTR, None)
    if admission is not None:
        admission.end(
            f"engine {sentinel.engine_index} faulted before the admission started ({exc!r}); "
            "once every survivor is HEALTHY again, send scale_up again with the 'dp_store' "
            "their status shows then"
        )


def _failure(done: concurrent.futures.Future[Any]) -> str | None:
    try:
        done.result()
    except Exception as exc:
        return f"the admission failed: {exc}"
    return None


def _wait_s(sentinel: Any) -> float:
    agent = getattr(sentinel, AGENT_ATTR, None)
    settings = getattr(agent, "settings", None)
    return float(getattr(settings, "recovery_timeout_s", None) or DEFAULT_WAIT_S)


def _answer(
    sentinel: Any, client_idx: int, call_id: int, request_id: str, ok: bool, reason: str | None
) -> None:
    utils, engine = import_vllm(UTILS_MODULE), import_vllm(ENGINE_MODULE)
    msgspec = import_vllm("msgspec")
    result = utils.FaultToleranceResult(request_id=request_id, success=ok, reason=reason)
    output = engine.UtilityOutput(call_id)
    output.result = import_vllm(SERIAL_MODULE).UtilityResult(msgspec.structs.asdict(result))
    sentinel.engine.output_queue.put_nowait(
        (client_idx, engine.EngineCoreOutputs(utility_output=output))
    )


@attrs.frozen
class AdmitMarker:
    """What the input thread queues for the busy loop (handled between two steps)."""

    sentinel: Any

    def run(self) -> None:
        admission = getattr(self.sentinel, ADMISSION_ATTR, None)
        if rejoining(self.sentinel.engine.vllm_config.parallel_config):
            if admission is not None and admission.claim():
                _settle(admission, lambda: join(self.sentinel, admission))
        else:
            self.sentinel.engine.engines_running = True  # step until the members agree


class NotAdmitted(FTEngineError, RuntimeError):
    """The returning rank could not reach the survivors' store or their admission: nothing
    of its own was changed, so it stays ``ready`` and a later ``scale_up`` may admit it."""


def _settle(admission: Admission, run: Any) -> None:
    try:
        run()
    except NotAdmitted as exc:
        admission.done.set_exception(exc)  # answered; the engine stays as it was
        return
    except BaseException as exc:
        admission.done.set_exception(exc)
        raise  # the busy loop's fault path: the groups may be half rebuilt
    admission.done.set_result(True)


def at_dp_sync(engine: Any, engines_running: bool) -> bool:
    """After vLLM's DP-state sync (every member, same step): the admission vote, and the
    admission itself once every member admits the same ranks (module doc). Returns whether
    the engines keep running.

    Each member votes for the ranks it admits now: a pending ``scale_up``'s once their join
    keys are on the store, else those its policy admits (:func:`offer`); one MIN all-reduce
    of a vote per original DP rank gives the ranks every member admits, the same on each
    (one more entry says whether any member votes: then all keep stepping to the next sync;
    a member's agent wakes its busy loop when it has a vote to cast)."""
    sentinel = getattr(engine, "ft_sentinel", None)
    if sentinel is None or getattr(engine, "dp_group", None) is None:
        return engines_running
    parallel = engine.vllm_config.parallel_config
    if rejoining(parallel):
        return engines_running  # alone until it joins (``join``)
    world = int(parallel.data_parallel_size)
    admission = getattr(sentinel, ADMISSION_ATTR, None)
    want: frozenset[int] = frozenset()
    claimed = admission is not None and admission.claim()
    if claimed and admission is not None and _joined(sentinel, admission):
        want = admission.added
    elif admission is None:
        want = frozenset(getattr(getattr(sentinel, AGENT_ATTR, None), "admissible", ()))
    ballot = [int(r in want) for r in range(world)] + [-int(bool(want))]
    vote = torch.tensor(ballot, dtype=torch.int32)
    torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MIN, group=engine.dp_group)
    agreed = frozenset(r for r in range(world) if int(vote[r].item()) == 1)
    if agreed:
        if claimed and admission is not None and admission.added == agreed:
            chosen = admission
        else:
            if claimed and admission is not None:
                admission.unclaim()  # its ranks are not all admitted now: it stays pending
            chosen = Admission(agreed, policy_request_id(), claimed=True)
        _settle(chosen, lambda: admit(sentinel, chosen))
        return True
    if claimed and admission is not None:
        admission.unclaim()
    return engines_running or int(vote[world].item()) < 0


def offer(sentinel: Any, policy: Any, rank: int, world: int, store: Any) -> frozenset[int]:
    """The agent thread, at each peer read: the removed ranks this survivor's ``policy``
    admits now (``decide_admission``), among those whose join key is on its DP store (a
    returning rank writes it once ready: ``engine_core/announce.py``). The busy loop is
    woken when the set is new, so idle members step to the sync where they vote. ``store``:
    the engine's DP store as the agent calls it (bounded)."""
    removed = frozenset(getattr(sentinel, REMOVED_ATTR, frozenset()))
    if not removed or store is None or sentinel.status_type.name != "HEALTHY":
        return frozenset()
    try:
        joined = frozenset(r for r in removed if store.check([join_key(r)]))
    except Exception:  # a store that fails: the peer watch reports it, nothing is admitted
        return frozenset()
    if not joined:
        return frozenset()
    ctx = AdmissionContext(
        ready_ranks=joined, removed_ranks=removed, now=time.monotonic(), rank=rank,
        world_size=world, epoch=int(getattr(sentinel, EPOCH_ATTR, 0)),
    )  # fmt: skip
    decision = decide_admission(policy, ctx)
    return frozenset() if decision is None else frozenset(decision.ranks) & joined


def command_ready(sentinel: Any, store: Any) -> Admission | None:
    """A survivor's pending ``scale_up`` whose ranks have all joined on ``store`` (its DP
    store; the agent thread wakes the busy loop for it once), or None."""
    admission = getattr(sentinel, ADMISSION_ATTR, None)
    if admission is None or admission.done.done():
        return None
    if rejoining(sentinel.engine.vllm_config.parallel_config):
        return None
    return admission if _joined(sentinel, admission, store) else None


def wake(sentinel: Any) -> None:
    """Queue the marker that has the busy loop step until the members vote (any thread)."""
    sentinel.engine.input_queue.put_nowait((ADMIT_MARK, AdmitMarker(sentinel)))


def _joined(sentinel: Any, admission: Admission, store: Any = None) -> bool:
    """Whether every returning rank has written its join key on this survivor's store
    (``store``: the agent's bounded view of it; None: the engine's own)."""
    store = sentinel.engine.dp_store if store is None else store
    try:
        return bool(store.check([join_key(r) for r in sorted(admission.added)]))
    except Exception:
        return False


def admit(sentinel: Any, admission: Admission) -> None:
    """A survivor, at the agreed step: the lowest survivor publishes the admission's facts,
    every member rebuilds the DP group with the returning ranks, the worker follows."""
    engine = sentinel.engine
    parallel = engine.vllm_config.parallel_config
    world, rank = int(parallel.data_parallel_size), int(parallel.data_parallel_rank)
    removed = frozenset(getattr(sentinel, REMOVED_ATTR, frozenset()))
    survivors = [r for r in range(world) if r not in removed]
    alive = sorted({*survivors, *admission.added})
    started = time.monotonic()
    if rank == survivors[0]:
        agent = getattr(sentinel, AGENT_ATTR, None)
        worker_epoch = (agent.status_fields() if agent is not None else {}).get("epoch")
        facts = {
            "epoch": int(getattr(sentinel, EPOCH_ATTR, 0)),
            REMOVED_KEY: sorted(removed),
            ADDED_KEY: sorted(admission.added),
            "worker_epoch": worker_epoch,
            "wave": int(getattr(engine, "current_wave", 0)),
        }
        for added in sorted(admission.added):
            engine.dp_store.set(admit_key(added), json.dumps(facts).encode())
    params = reinit_dp_group(sentinel, alive, publisher=survivors[0])
    params[ADDED_KEY] = sorted(admission.added)
    _relay(sentinel, admission, params)
    agent = getattr(sentinel, AGENT_ATTR, None)
    if agent is not None:
        agent.readmit(admission.added)  # their old processes' addresses are closed
        agent.admissible = frozenset()
    setattr(sentinel, REMOVED_ATTR, removed - admission.added)
    _members_from_here(engine, alive, rank)
    logger.info(
        "[FT] engine %d admitted DP ranks %s in %.3f s (epoch %s, removed now %s)",
        *(rank, sorted(admission.added), time.monotonic() - started),
        *(getattr(sentinel, EPOCH_ATTR, "?"), sorted(removed - admission.added)),
    )  # fmt: skip
    sentinel._push_status()


def join(sentinel: Any, admission: Admission) -> None:
    """The returning rank, between two steps: announce itself on the survivors' store, take
    the admission's facts, join the new DP group, let the worker join, serve."""
    if admission.store is None:
        raise CommandRejected("a returning rank needs the survivors' DP store")
    engine = sentinel.engine
    parallel = engine.vllm_config.parallel_config
    rank = int(parallel.data_parallel_rank)
    started = time.monotonic()
    try:
        store = survivors_store(*admission.store, parallel.cpu_distributed_timeout)
        store.set(join_key(rank), b"1")
        facts = json.loads(store.get(admit_key(rank)).decode())
    except Exception as exc:  # before anything of this engine changed
        host, port = admission.store
        raise NotAdmitted(
            f"DP rank {rank} was not admitted through the survivors' DP store {host}:{port}: "
            f"{exc} (every survivor needs the scale_up command; 'dp_store' must be the one "
            "their status shows now)"
        ) from exc
    removed = frozenset(int(r) for r in facts[REMOVED_KEY])
    added = frozenset(int(r) for r in facts.get(ADDED_KEY, admission.added))
    world = int(parallel.data_parallel_size)
    alive = sorted({*(r for r in range(world) if r not in removed), *added})
    survivors = [r for r in range(world) if r not in removed]
    setattr(sentinel, EPOCH_ATTR, int(facts["epoch"]))
    params = reinit_dp_group(sentinel, alive, publisher=survivors[0], store=store)
    params[ADDED_KEY] = sorted(added)
    params[REMOVED_KEY] = sorted(removed)
    if facts.get("worker_epoch") is not None:
        params[EPOCH_KEY] = int(facts["worker_epoch"])
    setattr(parallel, REJOIN_KEY, 0)  # a member from here: the worker's FSM speaks for it
    _relay(sentinel, admission, params)
    setattr(sentinel, REMOVED_ATTR, removed - added)
    engine.current_wave = int(facts.get("wave", 0))
    _members_from_here(engine, alive, rank)
    engine.engines_running = True  # the survivors step on from here: so does this engine
    logger.info(
        "[FT] engine %d joined the running deployment in %.3f s (epoch %s, members %s)",
        *(rank, time.monotonic() - started, getattr(sentinel, EPOCH_ATTR, "?"), alive),
    )  # fmt: skip
    sentinel._push_status()


def survivors_store(host: str, port: int, timeout: timedelta | None) -> Any:
    """A client of the survivors' DP store (the TCPStore vLLM's stateless rendezvous made,
    which it hands back unprefixed: ftengine's keys sit at its top level)."""
    from ftengine.integrations.vllm.engine_core.standby_store import connect

    return connect((host, port), (timeout or timedelta(seconds=DEFAULT_WAIT_S)).total_seconds())


def _relay(sentinel: Any, admission: Admission, params: dict[str, Any]) -> None:
    request = import_vllm(UTILS_MODULE).FaultToleranceRequest(
        instruction=INSTRUCTION, params=params, request_id=admission.request_id
    )
    sentinel.engine.model_executor.collective_rpc("handle_ft_command", args=(request,))


def _members_from_here(engine: Any, alive: list[int], rank: int) -> None:
    """Every member counts DP-sync steps from the admission together; the lowest leads."""
    if hasattr(engine, WAVE_LEAD_ATTR):
        setattr(engine, WAVE_LEAD_ATTR, alive.index(rank))
    if hasattr(engine, "step_counter"):
        engine.step_counter = 0
