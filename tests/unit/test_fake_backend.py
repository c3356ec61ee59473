"""FakeBackend: the conformance suite, call recording, armed failures and hangs."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from ftengine.backends.base import Backend
from ftengine.backends.fake import Call, FakeBackend
from ftengine.errors import BackendError, CollectiveTimeout, ConfigError, DeviceError
from ftengine.faults import Fault, FaultKind
from tests.conformance import BackendConformance


class TestFakeBackendConformance(BackendConformance):
    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        backend = FakeBackend()
        yield backend
        backend.disarm()


def test_records_calls_in_order_with_arguments() -> None:
    backend = FakeBackend()
    fault = Fault(FaultKind.DEAD_PEER, rank=2)
    backend.quarantine(fault)
    backend.mask_ranks(frozenset({2}))
    backend.rebuild_groups(frozenset({0, 1}), 1)
    report = backend.repair_experts(frozenset({2}))
    assert backend.calls == (
        Call("quarantine", (fault,)),
        Call("mask_ranks", (frozenset({2}),)),
        Call("rebuild_groups", (frozenset({0, 1}), 1)),
        Call("repair_experts", (frozenset({2}),)),
    )
    assert report.reloads == 2 and report.reloaded == ((0, 2), (1, 2))
    assert backend.count("rebuild_groups") == 1 and backend.count("reset_device") == 0


def test_fails_on_the_nth_call_only_and_keeps_the_given_exception() -> None:
    backend = FakeBackend()
    error = DeviceError("poisoned stream")
    backend.fail_on("run_dummy_batch", error, nth=2)
    backend.run_dummy_batch()
    with pytest.raises(DeviceError) as caught:
        backend.run_dummy_batch()
    assert caught.value is error
    backend.run_dummy_batch()
    assert backend.names() == ["run_dummy_batch"] * 3


def test_fail_on_defaults_to_the_next_call_with_a_backend_error() -> None:
    backend = FakeBackend()
    backend.reset_device()
    backend.fail_on("reset_device")
    with pytest.raises(BackendError, match="reset_device call #2"):
        backend.reset_device()


def test_hang_blocks_until_released() -> None:
    backend = FakeBackend()
    hang = backend.hang_on("rebuild_groups", timeout=30.0)
    done = threading.Event()

    def rebuild() -> None:
        backend.rebuild_groups(frozenset({0}), 1)
        done.set()

    worker = threading.Thread(target=rebuild)
    worker.start()
    assert hang.entered.wait(10.0)
    assert not done.is_set()
    hang.release()
    worker.join(10.0)
    assert done.is_set() and backend.epoch == 1


def test_an_unreleased_hang_times_out_as_a_collective_timeout() -> None:
    backend = FakeBackend()
    backend.hang_on("run_dummy_batch", timeout=0.0)
    with pytest.raises(CollectiveTimeout, match="never released"):
        backend.run_dummy_batch()


def test_disarm_drops_failures_and_releases_hangs() -> None:
    backend = FakeBackend()
    backend.fail_on("reset_device")
    hang = backend.hang_on("run_dummy_batch", timeout=0.0)
    backend.disarm()
    backend.reset_device()
    backend.run_dummy_batch()
    assert not hang.entered.is_set()


def test_on_call_sees_each_call_before_it_runs() -> None:
    seen: list[Call] = []
    backend = FakeBackend(on_call=seen.append)
    backend.fail_on("reset_device")
    with pytest.raises(BackendError):
        backend.reset_device()
    assert seen == [Call("reset_device")]


def test_arming_an_unknown_action_fails_loudly() -> None:
    with pytest.raises(ConfigError, match="unknown backend action 'reboot'"):
        FakeBackend().fail_on("reboot")


def test_rebuild_epochs_must_grow() -> None:
    backend = FakeBackend()
    backend.rebuild_groups(frozenset({0}), 2)
    with pytest.raises(ValueError, match="epoch must grow"):
        backend.rebuild_groups(frozenset({0}), 2)
