"""Recovery benchmark on the CPU cluster: SIGKILL/SIGSTOP detection, scale-down interruption
vs a full restart (warm and cold page cache), retry time, FT overhead against the same
checkpoint on a fault-tolerance-off cluster, and expert reloads, measured side by side on one
checkpoint. Prints one JSON object; ``--plot`` draws tokens/s with fault and recovery marks."""

from __future__ import annotations

import argparse
import functools
import importlib
from pathlib import Path

from ftengine.cli.options import at_least, options_from_args
from ftengine.testbed.cli import launch
from ftengine.testbed.cli.extras import testbed_extra

BENCH = "recovery"
# About 600 MB of bf16 weights (experts dominate), so that reloading experts costs real I/O.
# Many small experts (moe_intermediate < hidden), as in Qwen3-MoE and DeepSeek, rather than a
# few large ones: a decode step streams one expert's weights per (token, expert) pair, so the
# expert size, not the checkpoint size, sets the step time.
BENCH_SIZE = launch.CheckpointSize(layers=4, experts=64, hidden=1024, intermediate=384, vocab=512)


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``bench recovery``'s flags."""
    parser.add_argument("--json", action="store_true", help="(always JSON; kept for symmetry)")
    parser.add_argument("--plot", type=Path, default=None, help="write a tokens/s PNG here")
    parser.add_argument(
        "--kill-trials",
        type=at_least(
            2, "the last trial of each launch only measures detection, so one scale-down needs two"
        ),
        default=10,
        help="SIGKILL trials (>= 2)",
    )
    parser.add_argument("--stop-trials", type=at_least(1), default=10, help="SIGSTOP trials (>= 1)")
    parser.add_argument(
        "--overhead-rounds",
        type=at_least(1),
        default=16,
        help="FT on/off rounds (each launch once)",
    )
    parser.add_argument(
        "--overhead-tokens", type=at_least(1), default=8, help="decode steps per round"
    )
    parser.add_argument(
        "--overhead-launches",
        type=at_least(1),
        default=2,
        help="cluster launches per side (FT on, FT off) for the overhead rounds; each "
        "launch of the default checkpoint holds about 3.5 GB",
    )
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds of steady traffic before each fault"
    )
    launch.add_run_args(parser, BENCH_SIZE)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (``ftengine.testbed.bench.recovery``) and print its JSON object."""
    with testbed_extra(f"bench {BENCH}"):
        from ftengine.testbed.bench.recovery import RecoveryOptions, run_recovery

        if args.plot is not None:
            # matplotlib is imported only to draw, after every measurement: check it first.
            importlib.import_module("matplotlib")
    return run_recovery(
        options_from_args(RecoveryOptions, args),
        launch.run_checkpoint(args),
        functools.partial(launch.cluster_config, args),
    )
