"""DelegatingBackend: forwards every ``Backend`` member, passes the conformance suite, and so
do the wrappers built on it (the sentinel's ``HostedBackend``, its vLLM worker subclass)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

from ftengine.backends.base import Backend
from ftengine.backends.delegating import DelegatingBackend
from ftengine.backends.fake import FakeBackend
from ftengine.faults import Fault, FaultKind
from ftengine.integrations.vllm.worker.backend import VllmHostedBackend
from ftengine.sentinel import HostedBackend
from tests.conformance import BackendConformance
from tests.unit.test_sentinel import RecordingHost


def protocol_methods() -> list[str]:
    """Every public method the ``Backend`` protocol declares, read off the protocol itself."""
    return sorted(
        name
        for name, member in vars(Backend).items()
        if not name.startswith("_") and callable(member)
    )


class Steps(RecordingHost):
    """A vLLM worker: a recording host plus the worker's own steps, recorded."""

    def __init__(self, backend: FakeBackend) -> None:
        super().__init__(backend)
        self.steps: list[tuple[str, object]] = []

    def mask_all2all(self, dead_ep_ranks: frozenset[int], mask: torch.Tensor | None) -> None:
        self.steps.append(("mask_all2all", dead_ep_ranks))

    def rebuild_dp_group(self, alive_dp_ranks: frozenset[int], epoch: int) -> None:
        self.steps.append(("rebuild_dp_group", (alive_dp_ranks, epoch)))


def test_the_protocol_is_read_with_every_method_it_had_when_this_was_written() -> None:
    # Guards the reading below: if it found nothing, the forwarding test would pass vacuously.
    known = {"set_op_timeout", "quarantine", "reset_device", "rebuild_groups", "mask_ranks"}
    known |= {"repair_experts", "run_dummy_batch", "synchronize"}
    assert known <= set(protocol_methods())


@pytest.mark.parametrize("method", protocol_methods())
def test_every_protocol_method_is_forwarded_to_inner_as_called(method: str) -> None:
    assert method in vars(DelegatingBackend), f"DelegatingBackend does not forward {method}"
    inner = mock.Mock(name="inner")
    parameters = list(inspect.signature(getattr(Backend, method)).parameters)[1:]  # no self
    args = tuple(object() for _ in parameters)
    result = getattr(DelegatingBackend(inner), method)(*args)
    getattr(inner, method).assert_called_once_with(*args)
    returns = inspect.signature(getattr(Backend, method)).return_annotation
    expected = None if returns in (None, "None") else getattr(inner, method).return_value
    assert result is expected
    assert [call[0] for call in inner.method_calls] == [method]  # nothing else was called


def test_every_protocol_attribute_is_the_inner_backends() -> None:
    inner = FakeBackend()
    delegating = DelegatingBackend(inner)
    assert set(Backend.__annotations__) == {"name"}
    assert all(
        getattr(delegating, attr) == getattr(inner, attr) for attr in Backend.__annotations__
    )


class TestDelegatingBackendConformance(BackendConformance):
    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        yield DelegatingBackend(FakeBackend())


class TestHostedBackendConformance(BackendConformance):
    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        device = FakeBackend()
        yield HostedBackend(device, RecordingHost(device))


class TestVllmHostedBackendConformance(BackendConformance):
    @pytest.fixture
    def backend(self) -> Iterator[Backend]:
        device = FakeBackend()
        yield VllmHostedBackend(device, Steps(device))


def test_hosted_backend_changes_only_quarantine_and_the_dummy_batch() -> None:
    device = FakeBackend()
    host = RecordingHost(device)
    hosted = HostedBackend(device, host)
    hosted.quarantine(Fault(FaultKind.TRANSIENT, rank=0))
    hosted.reset_device()
    hosted.run_dummy_batch()
    assert device.names() == ["quarantine", "reset_device"]  # the host ran the dummy batch
    assert host.log == ["clean_state", "dummy_batch@epoch0"]


def test_vllm_hosted_backend_adds_its_steps_after_the_devices() -> None:
    device = FakeBackend(rank=0)
    steps = Steps(device)
    backend = VllmHostedBackend(device, steps, tp_size=2)
    backend.mask_ranks(frozenset({1}))
    backend.rebuild_groups(frozenset({0}), 1)
    backend.synchronize()
    assert device.names() == ["mask_ranks", "rebuild_groups", "synchronize"]
    assert steps.steps == [
        ("mask_all2all", frozenset({2, 3})),  # DP rank 1 is EP ranks 2 and 3 at TP 2
        ("rebuild_dp_group", (frozenset({0}), 1)),
    ]
    assert steps.log == []  # the host's own hooks ran for none of these


def test_vllm_hosted_backend_is_a_hosted_backend_for_quarantine_and_the_dummy_batch() -> None:
    device = FakeBackend(rank=0)
    steps = Steps(device)
    backend = VllmHostedBackend(device, steps)
    backend.quarantine(Fault(FaultKind.TRANSIENT, rank=0))
    backend.run_dummy_batch()
    assert device.names() == ["quarantine"]  # the worker ran the dummy batch
    assert steps.log == ["clean_state", "dummy_batch@epoch0"]
    assert steps.steps == []


def test_admit_ranks_is_forwarded_only_to_a_backend_that_can_admit() -> None:
    from ftengine.backends.base import RepairReport
    from ftengine.backends.delegating import DelegatingBackend, admit_ranks, can_admit
    from ftengine.backends.fake import Call, FakeBackend
    from ftengine.errors import BackendError

    inner = FakeBackend(rank=0)
    inner.masked = frozenset({3})
    wrapped = DelegatingBackend(DelegatingBackend(inner))
    assert can_admit(wrapped)
    assert wrapped.admit_ranks(frozenset({3}), frozenset()) == RepairReport()
    assert inner.calls[-1] == Call("admit_ranks", (frozenset({3}), frozenset()))

    class Minimal:
        name = "minimal"

    assert not can_admit(DelegatingBackend(Minimal()))  # type: ignore[arg-type]
    with pytest.raises(BackendError, match="'minimal' cannot admit ranks"):
        admit_ranks(DelegatingBackend(Minimal()), frozenset({3}), frozenset())  # type: ignore[arg-type]
