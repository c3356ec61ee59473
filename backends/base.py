"""The device backend protocol: what the recovery engine asks a device to do.

Backends only act; they never decide. The engine calls these in the order of its step
table (``ftengine.recovery.STEPS``); every backend (fake, cpu, npu) passes the same
conformance suite in ``tests/conformance.py``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

from ftengine.faults import Fault


@attrs.frozen
class RepairReport:
    """What ``repair_experts`` did on this worker.

    ``reloaded`` lists the (layer, logical expert) pairs whose weights this worker
    read from disk into a slot; ``reloads`` counts them; ``reload_lower_bound`` is
    the number of logical experts (over all layers, cluster-wide) left with no live
    replica, i.e. the least any plan could reload; ``bytes_reloaded`` counts the
    bytes this worker read.
    """

    reloads: int = 0
    reload_lower_bound: int = 0
    bytes_reloaded: int = 0
    reloaded: tuple[tuple[int, int], ...] = ()


@runtime_checkable
class Backend(Protocol):
    """A device backend. Ranks are original DP ranks; ``epoch`` grows on every rebuild."""

    name: str

    def set_op_timeout(self, seconds: float) -> None:
        """Make a hung collective raise after ``seconds`` (0 turns the timeout off)."""

    def quarantine(self, fault: Fault) -> None:
        """Stop issuing collectives, clear a poisoned stream, clean in-flight work.

        Must not block on a peer: it runs while peers may be dead or hung.
        """

    def reset_device(self) -> None:
        """Reset the local device so that its streams and communicators work again."""

    def rebuild_groups(self, alive_ranks: frozenset[int], epoch: int) -> None:
        """Re-create every process group among ``alive_ranks`` for ``epoch``."""

    def mask_ranks(self, dead_ranks: frozenset[int]) -> None:
        """Stop routing work to ``dead_ranks`` (cumulative): elastic_info, DP-sync columns."""

    def repair_experts(self, dead_ranks: frozenset[int]) -> RepairReport:
        """Re-host experts of ``dead_ranks`` on survivors' slots, reloading weights in place."""

    def run_dummy_batch(self) -> None:
        """Run one small forward pass through every collective to prove the worker serves."""

    def synchronize(self) -> None:
        """Wait for all queued device work to finish."""


@runtime_checkable
class RankAdmitter(Protocol):
    """A backend that can take removed ranks back (``scale_up``); a capability apart from
    ``Backend`` so a backend without it keeps working and a scale-up to it is refused."""

    def admit_ranks(self, added: frozenset[int], removed: frozenset[int]) -> RepairReport:
        """Admit ``added`` (original DP ranks) back, ``removed`` being the cumulative set
        after the admission; runs after ``rebuild_groups`` spanned the new membership.

        On a survivor: un-mask ``added`` in place (``elastic_info``, DP-sync columns,
        physical width restored), give the returning ranks their original experts back in
        the maps and drop (or keep as standby) the copies grown for them; reload nothing.
        On a returning rank (``added`` holds its own rank): adopt the survivors' maps and
        reload only the slots it must hold that it did not load at start-up (normally
        none). Atomic locally: it raises before changing anything or not at all, once
        the survivors' maps are known. The report counts this worker's reloads.
        """
        ...
