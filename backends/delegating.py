"""``DelegatingBackend``: a backend that hands every ``Backend`` call to an inner one.

Wrappers that add a host's steps around a device backend (the sentinel's ``HostedBackend``,
the vLLM worker's backend) subclass it and override only the calls they change, so each
protocol method is forwarded in one place. It does not subclass the ``Backend`` protocol on
purpose: a method the protocol gains would then be inherited as a silent no-op, where now
``tests/unit/test_delegating_backend.py`` fails until it is forwarded here.
"""

from __future__ import annotations

from ftengine.backends.base import Backend, RankAdmitter, RepairReport
from ftengine.errors import BackendError
from ftengine.faults import Fault


class DelegatingBackend:
    """Forwards each ``Backend`` method to ``inner`` unchanged; ``name`` is ``inner``'s."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name

    def set_op_timeout(self, seconds: float) -> None:
        self.inner.set_op_timeout(seconds)

    def quarantine(self, fault: Fault) -> None:
        self.inner.quarantine(fault)

    def reset_device(self) -> None:
        self.inner.reset_device()

    def rebuild_groups(self, alive_ranks: frozenset[int], epoch: int) -> None:
        self.inner.rebuild_groups(alive_ranks, epoch)

    def mask_ranks(self, dead_ranks: frozenset[int]) -> None:
        self.inner.mask_ranks(dead_ranks)

    def repair_experts(self, dead_ranks: frozenset[int]) -> RepairReport:
        return self.inner.repair_experts(dead_ranks)

    def admit_ranks(self, added: frozenset[int], removed: frozenset[int]) -> RepairReport:
        return admit_ranks(self.inner, added, removed)

    def run_dummy_batch(self) -> None:
        self.inner.run_dummy_batch()

    def synchronize(self) -> None:
        self.inner.synchronize()


def can_admit(backend: object) -> bool:
    """Whether ``backend`` (through any ``DelegatingBackend`` wrappers) can admit ranks."""
    while isinstance(backend, DelegatingBackend):
        backend = backend.inner
    return isinstance(backend, RankAdmitter)


def admit_ranks(backend: object, added: frozenset[int], removed: frozenset[int]) -> RepairReport:
    """``backend.admit_ranks(added, removed)``; ``BackendError`` if it cannot admit ranks."""
    if not can_admit(backend) or not isinstance(backend, RankAdmitter):
        name = getattr(backend, "name", type(backend).__name__)
        raise BackendError(f"backend {name!r} cannot admit ranks (no admit_ranks)")
    return backend.admit_ranks(added, removed)
