"""What the demo and the benchmarks need from a cluster (``ftengine.testbed.cluster.Cluster``
has all of it), so that they run as well over the unit tests' stand-in cluster."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ftengine.testbed.cluster.config import ClusterConfig


class GenerationLike(Protocol):
    """``ftengine.testbed.cluster.Generation``'s fields."""

    @property
    def token_ids(self) -> tuple[int, ...]: ...
    @property
    def final_logits(self) -> tuple[float, ...]: ...


class PhaseEventLike(Protocol):
    """``ftengine.testbed.cluster.protocol.PhaseEvent``'s fields."""

    @property
    def source(self) -> str: ...
    @property
    def dest(self) -> str: ...
    @property
    def at(self) -> float: ...
    @property
    def reason(self) -> str: ...


class EventLike(Protocol):
    """``ftengine.testbed.cluster.ClusterEvent``'s fields."""

    @property
    def at(self) -> float: ...
    @property
    def kind(self) -> str: ...
    @property
    def rank(self) -> int | None: ...
    @property
    def detail(self) -> str: ...


class Watchable(Protocol):
    """What a watcher reads from a cluster."""

    def status(self) -> Mapping[str, Any]: ...
    def phase_changes(self) -> Mapping[int, Sequence[PhaseEventLike]]: ...
    def events(self) -> Sequence[EventLike]: ...


class ScenarioCluster(Watchable, Protocol):
    """The ``Cluster`` API the demo's scenario drives."""

    def apply(self, instruction: str, params: Mapping[str, object], request_id: str) -> Any: ...
    def generate(self, prompt_token_ids: list[int], max_tokens: int) -> list[int]: ...
    def generate_batch(
        self, prompts: Sequence[Sequence[int]], max_tokens: int
    ) -> Sequence[GenerationLike]: ...
    def kill(self, rank: int, sig: int = ...) -> None: ...


class BenchCluster(ScenarioCluster, Protocol):
    """The ``Cluster`` API the recovery benchmark drives."""

    def live_ranks(self) -> frozenset[int]: ...
    def pids(self) -> Mapping[int, int | None]: ...
    def shutdown(self) -> None: ...


Compare = Callable[..., Any]
"""``ftengine.testbed.cluster.compare_outputs``: returns an object with ``.match`` and
``.to_dict()``."""


class ConfigFor(Protocol):
    """A ``ClusterConfig`` for ``checkpoint`` from the command's cluster flags, ``overrides``
    winning (``ftengine.testbed.cli.launch.cluster_config`` with the parsed flags bound)."""

    def __call__(self, checkpoint: Path, /, **overrides: object) -> ClusterConfig: ...
