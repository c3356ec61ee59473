"""``ftengine bench rejoin``: its registration, the pause and ratio arithmetic, and the
``--target vllm`` seam answering that it is not available yet (exit 1, nothing run)."""

from __future__ import annotations

import pytest

from ftengine import cli
from ftengine.testbed.bench.rejoin import (
    RejoinBenchError,
    RejoinSetup,
    Stream,
    pause_caused,
    run_target,
    summarize_ratio,
)

pytestmark = pytest.mark.timeout(30)


def stream(*times: float) -> Stream:
    return Stream((1,), times, tuple(range(len(times))), "length")


def test_the_pause_is_the_longest_gap_overlapping_the_admission() -> None:
    streams = [stream(0.0, 0.1, 0.2, 0.9, 1.0), stream(0.05, 0.15, 0.25, 0.35)]
    longest, typical = pause_caused(streams, start=0.3, end=0.5)
    assert longest == pytest.approx(0.7)  # 0.2 -> 0.9 straddles the window
    assert typical == pytest.approx(0.1)
    assert pause_caused([stream(0.0, 0.1)], start=5.0, end=6.0)[0] == 0.0


def test_the_ratio_is_of_medians_with_each_sides_spread() -> None:
    summary = summarize_ratio([100.0, 90.0, 110.0], [95.0, 100.0, 105.0])
    assert summary["throughput_after_over_before"] == 1.0
    assert summary["throughput_noise"] == {"before_spread": 0.2222, "after_spread": 0.1053}


def test_the_vllm_target_is_a_seam_that_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RejoinBenchError, match="not available yet"):
        run_target("vllm", RejoinSetup(), {})
    with pytest.raises(RejoinBenchError, match="unknown target"):
        run_target("tpu", RejoinSetup(), {})
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "rejoin", "--target", "vllm", "--json"])
    assert args.func(args) == 1
    assert "--target cluster" in capsys.readouterr().err
