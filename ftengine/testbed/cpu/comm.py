"""Gloo process groups for the CPU backend: one group per epoch, per-op timeouts, typed errors.

Each epoch's group is a ``ProcessGroupGloo`` built directly (no global default group)
on a ``PrefixStore`` named after the epoch and its members, so a rebuild never meets
the keys of an older one. Every collective passes its own ``timeout`` option: that is
what stops a hung gloo op (``work.wait(timeout)`` does not, and ``abort()`` is a no-op).
Gloo failures come back as :class:`~ftengine.errors.CollectiveTimeout` (a peer stopped
answering) or :class:`~ftengine.errors.PeerDead` (a peer's socket closed). A dropped group
is torn down on a helper thread (:meth:`GlooGroup.release`): destroying a ProcessGroupGloo
joins its I/O threads and closes its pairs, 10-30 ms measured after a peer died, which
would otherwise hold up the failed step's reply and so the whole recovery.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store

from ftengine.collective_errors import error_text, message_family
from ftengine.errors import BackendError, CollectiveTimeout, PeerDead, PreconditionFailed
from ftengine.faults import FaultKind

logger = logging.getLogger(__name__)


def translate_gloo_error(exc: BaseException, what: str) -> BackendError:
    """The typed ftengine error for a gloo failure of collective ``what`` (cause kept by caller).

    Gloo raises a plain RuntimeError, so its message is all there is to go on; it is read
    with the classifier the sentinel uses (``ftengine.collective_errors``).
    """
    text = error_text(exc)
    family = message_family(text)
    kind = None if family is None else family.kind
    if kind is FaultKind.DEAD_PEER:
        return PeerDead(f"{what}: a peer closed its connection ({text})")
    if kind is FaultKind.HUNG_PEER:
        return CollectiveTimeout(f"{what}: a peer did not answer in time ({text})")
    return BackendError(f"{what} failed: {text}")


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


class GlooGroup:
    """One epoch's gloo group among ``members`` (original ranks, sorted = dense order).

    ``rank`` is this process's dense rank (its index in ``members``). Collectives are
    blocking and raise CollectiveTimeout / PeerDead / BackendError.
    """

    def __init__(
        self,
        store: Store,
        members: frozenset[int],
        my_rank: int,
        epoch: int,
        *,
        op_timeout_s: float,
        rendezvous_timeout_s: float,
    ) -> None:
        if my_rank not in members:
            raise PreconditionFailed(
                f"rank {my_rank} cannot join the epoch-{epoch} group of ranks {sorted(members)}: "
                "only alive ranks rebuild groups"
            )
        self.members = tuple(sorted(members))
        self.rank = self.members.index(my_rank)
        self.size = len(self.members)
        self.epoch = epoch
        self.op_timeout_s = op_timeout_s
        prefix = f"ftengine/epoch{epoch}/{'-'.join(map(str, self.members))}"
        try:
            # The constructor's timeout bounds the rendezvous (a peer may still be finishing
            # a timed-out op of the old epoch); each op passes its own, shorter timeout.
            # Any: torch's stubs put the collectives on ProcessGroup, not on the gloo Backend.
            self._pg: Any = dist.ProcessGroupGloo(
                PrefixStore(prefix, store),
                self.rank,
                self.size,
                _seconds(rendezvous_timeout_s),
            )
        except RuntimeError as exc:
            raise translate_gloo_error(exc, f"epoch-{epoch} group rendezvous") from exc

    def release(self) -> None:
        """Drop the gloo group, tearing it down on a daemon thread (the caller does not wait).

        The group is unusable afterwards. The teardown releases the GIL, so the caller's
        thread runs on while it happens.
        """
        # The list is the pg's only owner: the thread clearing it is the one that destroys
        # it, whichever thread runs first (the caller keeps no reference of its own).
        owner: list[Any] = [self._pg]
        self._pg = None
        threading.Thread(
            target=owner.clear, name=f"ftengine-gloo-release-{self.epoch}", daemon=True
        ).start()

    @property
    def _live_pg(self) -> Any:
        if self._pg is None:
            raise BackendError(
                f"epoch-{self.epoch} gloo group was released; expected a live group, "
                "rebuild the groups before running collectives"
            )
        return self._pg

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        opts.timeout = _seconds(self.op_timeout_s)
        try:
            self._live_pg.allreduce([tensor], opts).wait()
        except RuntimeError as exc:
            raise translate_gloo_error(exc, f"epoch-{self.epoch} all_reduce") from exc

    def all_to_all(
        self, inp: torch.Tensor, in_splits: list[int], out_splits: list[int]
    ) -> torch.Tensor:
        """``all_to_all_single`` along dim 0: send ``in_splits[r]`` rows to dense rank r.

        Returns ``[sum(out_splits), *inp.shape[1:]]``.
        """
        out = inp.new_empty((sum(out_splits), *inp.shape[1:]))
        opts = dist.AllToAllOptions()
        opts.timeout = _seconds(self.op_timeout_s)
        try:
            self._live_pg.alltoall_base(out, inp.contiguous(), out_splits, in_splits, opts).wait()
        except RuntimeError as exc:
            raise translate_gloo_error(exc, f"epoch-{self.epoch} all_to_all") from exc
        return out
