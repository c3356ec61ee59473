"""The Backend conformance suite: what every backend (fake, cpu, npu) must honour in one
process with world size 1.

Subclass ``BackendConformance`` in a ``test_*.py`` file and override the ``backend``
fixture (yield a fresh backend for rank ``rank`` of a one-rank world; tear it down after)::

    class TestCpuBackend(BackendConformance):
        @pytest.fixture
        def backend(self) -> Iterator[Backend]:
            backend = CpuBackend(...)
            yield backend
            backend.close()
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ftengine.backends.base import Backend, RepairReport
from ftengine.clock import ManualClock
from ftengine.engine import RecoveryEngine
from ftengine.faults import Fault, FaultKind, Phase
from ftengine.policies import OrchestratorDriven


class BackendConformance:
    """Backend protocol contract tests; subclasses provide the ``backend`` fixture."""

    rank = 0

    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        pytest.fail("a BackendConformance subclass must override the `backend` fixture")
        yield  # pragma: no cover  (makes this a generator fixture like the overrides)

    def fault(self) -> Fault:
        return Fault(FaultKind.TRANSIENT, rank=self.rank, step=1, info="RuntimeError", at=1.0)

    def test_is_a_named_backend(self, backend: Backend) -> None:
        assert isinstance(backend, Backend)
        assert isinstance(backend.name, str) and backend.name

    def test_set_op_timeout_accepts_zero_and_positive(self, backend: Backend) -> None:
        backend.set_op_timeout(30.0)
        backend.set_op_timeout(0)  # 0 turns the timeout off

    def test_set_op_timeout_rejects_negative(self, backend: Backend) -> None:
        with pytest.raises(ValueError):
            backend.set_op_timeout(-1.0)

    def test_retry_order_runs(self, backend: Backend) -> None:
        backend.quarantine(self.fault())
        backend.reset_device()
        backend.rebuild_groups(frozenset({self.rank}), 1)
        backend.run_dummy_batch()
        backend.synchronize()

    def test_scale_down_order_runs_with_nothing_dead(self, backend: Backend) -> None:
        backend.quarantine(self.fault())
        backend.mask_ranks(frozenset())
        backend.rebuild_groups(frozenset({self.rank}), 1)
        report = backend.repair_experts(frozenset())
        backend.run_dummy_batch()
        assert isinstance(report, RepairReport)

    def test_repairing_nothing_reloads_nothing(self, backend: Backend) -> None:
        report = backend.repair_experts(frozenset())
        assert isinstance(report, RepairReport)
        assert (report.reloads, report.bytes_reloaded, report.reloaded) == (0, 0, ())

    def test_rebuild_rejects_an_empty_alive_set(self, backend: Backend) -> None:
        with pytest.raises(ValueError):
            backend.rebuild_groups(frozenset(), 1)

    def test_repeated_quarantine_and_rebuilds_with_growing_epochs(self, backend: Backend) -> None:
        for epoch in (1, 2, 3):
            backend.quarantine(self.fault())
            backend.quarantine(self.fault())
            backend.rebuild_groups(frozenset({self.rank}), epoch)
            backend.run_dummy_batch()

    def test_engine_recovers_through_it(self, backend: Backend) -> None:
        engine = RecoveryEngine(
            OrchestratorDriven(), backend, rank=self.rank, world_size=1, clock=ManualClock()
        )
        engine.report_fault(self.fault())
        result = engine.apply("retry", {}, "conformance-retry")
        assert result.success, result.reason
        assert (engine.phase, engine.epoch) == (Phase.HEALTHY, 1)
