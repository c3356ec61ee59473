"""The recovery benchmark's FT-overhead rounds and restart timing, over stand-ins: the rounds
interleave, the ratio is of medians with the per-round spread beside it, the idle cluster's
CPU is charged to the other side's rounds, and a cold restart evicts the checkpoint first."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from ftengine.testbed.bench import trials
from ftengine.testbed.bench.overhead import interleaved_rounds
from ftengine.testbed.bench.trials import quantile, spread, timed_restart

PROMPTS = [[1, 2], [3]]


class Timed:
    """A cluster whose rounds take the canned seconds per step, and whose workers have pids."""

    def __init__(self, name: str, steps: Sequence[float], pids: Mapping[int, int]) -> None:
        self.name = name
        self.steps = list(steps)
        self._pids = pids
        self.generated: list[list[int]] = []

    def pids(self) -> Mapping[int, int | None]:
        return self._pids

    def generate(self, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
        self.generated.append(prompt_token_ids)
        return [0] * max_tokens

    def __getattr__(self, name: str) -> Any:  # the rest of BenchCluster is never called here
        raise AttributeError(name)


def test_rounds_interleave_and_report_the_ratio_of_medians_with_its_spread() -> None:
    # warm-up first, then 4 rounds each; "on" is 10 % slower except one noisy round.
    on = Timed("on", [9.0, 1.1, 1.1, 3.0, 1.1], {0: 100})
    off = Timed("off", [9.0, 1.0, 1.0, 1.0, 1.0], {0: 200})
    order: list[str] = []
    cpu_used = {100: 0.0, 200: 0.0}

    def step_time(cluster: Any, prompts: Sequence[Sequence[int]], tokens: int) -> float:
        assert (prompts, tokens) == (PROMPTS, 5)
        order.append(cluster.name)
        if cluster is off:  # the idle FT-on workers burn 0.05 s per FT-off round
            cpu_used[100] += 0.05
        return float(cluster.steps.pop(0))

    def cpu(pids: Iterable[int | None]) -> float:
        return sum(cpu_used[pid] for pid in pids if pid is not None)

    rounds = interleaved_rounds([on], [off], PROMPTS, 5, 4, cpu=cpu, step_time=step_time)
    assert order == ["on", "off", "on", "off", "off", "on", "on", "off", "off", "on"]
    assert rounds.on_s == ((1.1, 1.1, 3.0, 1.1),) and rounds.off_s == ((1.0,) * 4,)
    fields = rounds.to_dict()
    assert fields["ft_overhead_ratio"] == pytest.approx(1.1)
    paired = fields["ft_overhead_round_ratios"]
    assert isinstance(paired, Mapping)
    assert (paired["min"], paired["max"], paired["n"]) == (pytest.approx(1.1), 3.0, 4)
    # 4 FT-off rounds of 5 steps of 1 s each; the idle FT-on cluster used 0.2 s meanwhile.
    assert fields["ft_overhead_idle_cores"] == {
        "ft_on_idle_during_off_rounds": pytest.approx(0.2 / 20.0),
        "ft_off_idle_during_on_rounds": 0.0,
    }


def test_several_launches_per_side_are_pooled_with_their_own_noise_beside() -> None:
    # Two launches per side; launch 1 of each side is 4 % slower than launch 0 of it.
    on = [Timed("on0", [9.0] + [1.00] * 3, {0: 1}), Timed("on1", [9.0] + [1.04] * 3, {0: 2})]
    off = [Timed("off0", [9.0] + [1.00] * 3, {0: 3}), Timed("off1", [9.0] + [1.04] * 3, {0: 4})]
    order: list[str] = []

    def step_time(cluster: Any, prompts: Sequence[Sequence[int]], tokens: int) -> float:
        order.append(cluster.name)
        return float(cluster.steps.pop(0))

    rounds = interleaved_rounds(on, off, PROMPTS, 2, 3, cpu=lambda pids: 0.0, step_time=step_time)
    warm, first, second = order[:4], order[4:8], order[8:12]
    assert warm == first == ["on0", "off0", "on1", "off1"]
    assert second == ["off0", "on1", "off1", "on0"]  # each round starts one launch later
    fields = rounds.to_dict()
    assert fields["ft_overhead_ratio"] == pytest.approx(1.0)
    assert fields["ft_overhead_launch_ratios"] == {
        "on0/off0": pytest.approx(1.0),
        "on0/off1": pytest.approx(1 / 1.04),
        "on1/off0": pytest.approx(1.04),
        "on1/off1": pytest.approx(1.0),
    }
    assert fields["ft_overhead_same_mode_ratios"] == {
        "on0/on1": pytest.approx(1 / 1.04),
        "off0/off1": pytest.approx(1 / 1.04),
    }


def test_rounds_need_a_cluster_on_each_side() -> None:
    with pytest.raises(ValueError, match="at least one cluster per side"):
        interleaved_rounds([], [Timed("off", [1.0], {})], PROMPTS, 1, 1)


def test_quantiles_and_spread() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert quantile(values, 0.5) == 3.0
    assert quantile(values, 0.1) == pytest.approx(1.4)
    assert spread(values) == {
        "min": 1.0,
        "p10": pytest.approx(1.4),
        "median": 3.0,
        "p90": pytest.approx(4.6),
        "max": 5.0,
        "n": 5,
    }
    assert spread([])["n"] == 0 and spread([])["median"] is None


def test_a_cold_restart_evicts_the_checkpoint_before_launching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("config.json", "model-00001.safetensors"):
        (tmp_path / name).write_text("x")
    (tmp_path / "subdir").mkdir()
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(trials, "evict", lambda files: calls.append(("evict", files)))
    monkeypatch.setattr(trials, "cached_fraction", lambda files: 0.0)
    cluster = Timed("on", [], {})

    def launch() -> Any:
        calls.append(("launch", None))
        return cluster

    started, cold = timed_restart(launch, [7, 8], tmp_path, cold=True)
    assert started is cluster and cluster.generated == [[7, 8]]
    files = [tmp_path / "config.json", tmp_path / "model-00001.safetensors"]
    assert calls == [("evict", files), ("launch", None)]
    assert (cold.cold, cold.cached) == (True, 0.0) and cold.seconds >= 0.0

    calls.clear()
    _, warm = timed_restart(launch, [7, 8], tmp_path, cold=False)
    assert calls == [("launch", None)]
    assert (warm.cold, warm.cached) == (False, None)
