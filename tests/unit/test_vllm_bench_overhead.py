"""The vLLM benchmark's overhead arithmetic: interleaved order, ratios, same-mode noise and
the verdict (the deployments themselves are measured by ``ftengine bench vllm``)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ftengine.testbed.bench.vllm_overhead import (
    Sample,
    alternating,
    compare,
    interleaved,
    overhead,
    verdict,
)


def test_rounds_alternate_which_side_goes_first_after_one_warm_up_each() -> None:
    calls: list[str] = []

    def side(name: str) -> Sample:
        calls.append(name)
        return Sample(1.0, 1.0)

    on, off = interleaved(lambda: side("on"), lambda: side("off"), 3)
    assert calls == ["on", "off", "on", "off", "off", "on", "on", "off"]
    assert len(on) == len(off) == 3


def test_ratio_of_medians_and_same_mode_noise_of_even_over_odd_rounds() -> None:
    found = compare([1.1, 1.0, 1.3, 1.0], [1.0, 1.0, 1.0, 1.0])
    assert found["ratio"] == pytest.approx(1.05)
    assert found["ratio_p10"] == pytest.approx(1.0)  # the lower tail: 1.0 against 1.0
    assert compare([3.0, 1.2, 9.0], [1.0, 5.0, 2.0])["ratio_p10"] == pytest.approx(1.56 / 1.2)
    assert found["same_mode_ratio"] == {"on": pytest.approx(1.2), "off": pytest.approx(1.0)}
    assert found["same_mode_spread"] == {"on": pytest.approx(1.3), "off": pytest.approx(1.0)}
    assert str(found["verdict"]).startswith("within measured noise")


@pytest.mark.parametrize(
    ("ratio", "noise", "expected"),
    [
        (1.005, [1.005, 1.0], "met: <= 1.01 (same-mode noise 0.5%)"),
        (0.9, [1.0, 1.0], "met"),
        (1.005, [1.5, 1.0], "not shown: <= 1.01, but same-mode noise 50.0% (> 1 %)"),
        (0.68, [0.94, 0.70], "not shown"),
        (1.04, [0.95, 1.0], "within measured noise"),
        (1.04, [1.01, 1.02], "not met"),
    ],
)
def test_verdict(ratio: float, noise: list[float], expected: str) -> None:
    assert verdict(ratio, noise).startswith(expected)


def test_a_measure_coarser_than_one_percent_shows_no_verdict_of_met() -> None:
    """psutil's CPU times step by one clock tick: over 48 tokens ~1.4 % of a 15 ms token,
    so equal medians say nothing at the 1 % level (seen: every launch 15.21 ms)."""
    assert verdict(1.0, [1.0, 1.0], 0.014).startswith(
        "not shown: <= 1.01, but same-mode noise 0.0%, resolution 1.4% (> 1 %)"
    )
    assert verdict(1.0, [1.0, 1.0], 0.005) == "met: <= 1.01 (same-mode noise 0.0%, resolution 0.5%)"
    step = 0.01 / 48
    on = [Sample(1.0, 0.73 / 48, step)] * 2
    found = overhead(on, on)["cpu"]
    assert found["resolution"] == pytest.approx(step / (0.73 / 48))  # type: ignore[index]
    assert str(found["verdict"]).startswith("not shown")  # type: ignore[index]


def test_overhead_compares_wall_and_cpu_time_and_needs_two_rounds() -> None:
    on = [Sample(2.0, 1.0), Sample(2.0, 1.0)]
    off = [Sample(1.0, 1.0), Sample(1.0, 1.0)]
    found = overhead(on, off)
    assert found["rounds"] == 2
    assert found["wall"]["ratio"] == pytest.approx(2.0)  # type: ignore[index]
    assert found["cpu"]["ratio"] == pytest.approx(1.0)  # type: ignore[index]
    with pytest.raises(ValueError, match="need >= 2 samples per side, found 1 on, 2 off"):
        overhead(on[:1], off)


def test_alternating_launches_one_deployment_at_a_time_in_abba_order() -> None:
    events: list[str] = []
    open_now: list[int] = []

    @contextlib.contextmanager
    def launch(ft: bool, index: int) -> Iterator[Callable[[], Sample]]:
        assert not open_now, "two deployments at once"
        open_now.append(index)
        events.append(f"{'on' if ft else 'off'}{index}")
        per_token = [1.0 + index, 5.0, 2.0 + index, 3.0 + index]  # warm-up, then 3 rounds
        taken = iter(per_token)
        yield lambda: Sample(next(taken), 1.0)
        open_now.pop()

    lines: list[str] = []
    on, off = alternating(launch, 2, 3, progress=lines.append)
    assert events == ["on0", "off1", "off2", "on3"]
    # each launch's figure: the median of its rounds after the warm-up (5, 2+i, 3+i)
    assert on == [Sample(3.0, 1.0), Sample(5.0, 1.0)]
    assert off == [Sample(4.0, 1.0), Sample(5.0, 1.0)]
    assert len(lines) == 4 and lines[0].startswith("launch 1/4 (FT on): 3000.00 ms wall")
    found = overhead(on, off, "alternating")
    assert found["method"] == "alternating" and found["launches"] == 2
    with pytest.raises(ValueError, match="need >= 2 launches per side"):
        alternating(launch, 1, 3)


def test_bench_vllm_cpu_wait_flag_reaches_every_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ftengine bench vllm --cpu-wait nap`` launches each deployment with ``cpu_nap``
    (the default: vLLM's own yield); the JSON says which."""
    from ftengine.testbed.bench import vllm as bench
    from ftengine.testbed.cli import bench_vllm
    from ftengine.testbed.vllm.launcher import DeploymentConfig, VllmDeployment

    (tmp_path / "config.json").write_text("{}")  # a checkpoint directory, as the config checks
    started: list[DeploymentConfig] = []
    monkeypatch.setattr(VllmDeployment, "start", classmethod(lambda _cls, c: started.append(c)))
    parser = argparse.ArgumentParser()
    bench_vllm.register(parser)
    for flags, nap in (([], False), (["--cpu-wait", "nap"], True)):
        args = parser.parse_args(["--checkpoint", str(tmp_path), *flags])
        bench._launch(bench.BenchConfig(tmp_path, cpu_nap=args.cpu_wait == "nap"), 0, True, {})
        assert started[-1].cpu_nap is nap
    monkeypatch.setattr(bench, "run_overhead", lambda _config: {})
    head = bench.run(bench.BenchConfig(tmp_path, overhead_only=True, cpu_nap=True))
    assert head["cpu_wait"] == "nap"
