"""``ftengine bench rejoin``: its registration, the pause and ratio arithmetic, a bad target
or victim refused before anything starts (exit 1, saying why), and the vLLM target's reading
of the survivors' admission log line."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftengine import cli
from ftengine.testbed.bench import rejoin_vllm
from ftengine.testbed.bench.rejoin import (
    RejoinBenchError,
    RejoinSetup,
    Stream,
    longest_gap,
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


def test_the_floor_is_the_longest_gap_of_any_fault_free_stream() -> None:
    assert longest_gap([stream(0.0, 0.1, 0.6), stream(1.0, 1.2)]) == pytest.approx(0.5)
    assert longest_gap([stream(0.0)]) == 0.0  # one chunk: no gap


def test_the_ratio_is_of_medians_with_each_sides_spread() -> None:
    summary = summarize_ratio([100.0, 90.0, 110.0], [95.0, 100.0, 105.0])
    assert summary["throughput_after_over_before"] == 1.0
    assert summary["throughput_noise"] == {"before_spread": 0.2222, "after_spread": 0.1053}


def test_a_bad_target_or_victim_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(RejoinBenchError, match="unknown target"):
        run_target("tpu", RejoinSetup(), {})
    with pytest.raises(RejoinBenchError, match="victim 3 must be a DP rank of dp=3"):
        run_target("vllm", RejoinSetup(dp=3, victim=3), {})
    with pytest.raises(RejoinBenchError, match="ask for at most 252"):
        run_target("vllm", RejoinSetup(dp=3, victim=2, stream_tokens=400), {})
    with pytest.raises(RejoinBenchError, match="admit the restarted rank the moment it is ready"):
        run_target("vllm", RejoinSetup(dp=3, victim=2, policy="auto"), {})
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "rejoin", "--target", "vllm", "--dp", "2", "--victim", "5"])
    assert args.func(args) == 1
    assert "victim 5 must be a DP rank of dp=2" in capsys.readouterr().err


def test_the_vllm_target_reads_the_reloads_off_the_admission_log_line(tmp_path: Path) -> None:
    log = tmp_path / "rank0.log"
    log.write_text(
        "(Worker_DP0_EP0 pid=1) INFO 12-03 05:28:42 [experts_rehost.py:348] [FT] EP rank 0: "
        "DP ranks [2] admitted back; 2 expert copies unrouted and kept, 0 reloaded\n"
        "(Worker_DP0_EP0 pid=1) INFO [FT] EP rank 0: DP ranks [1, 2] admitted back; 4 expert "
        "copies unrouted and kept, 3 reloaded\n"
    )
    assert rejoin_vllm._reloads(log) == 3
    assert rejoin_vllm._reloads(tmp_path / "missing.log") == 0
