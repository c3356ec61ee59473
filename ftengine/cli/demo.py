"""Run the main job end to end: SIGKILL a rank of a DP=4 CPU cluster under traffic and watch
it recover (scale down), checked against a fault-free reference. Exits 0 only if all held."""

from __future__ import annotations

import argparse
import functools

from ftengine.cli import launch
from ftengine.cli.extras import bench_extra
from ftengine.cli.options import options_from_args

COMMAND = "demo"
DEMO_SIZE = launch.CheckpointSize(layers=2, experts=8, hidden=64, intermediate=64, vocab=256)


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``demo``'s flags."""
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--victim", type=int, default=3, help="DP rank to SIGKILL")
    parser.add_argument("--prompts", type=int, default=4, help="number of fixed prompts")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per prompt")
    parser.add_argument(
        "--plain", action="store_true", help="timestamped lines instead of a live table"
    )
    launch.add_run_args(parser, DEMO_SIZE)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo (``ftengine.bench.demo``) on the checkpoint and cluster the flags name."""
    with bench_extra(COMMAND):
        from ftengine.bench.demo import DemoOptions, run_demo

    return run_demo(
        options_from_args(DemoOptions, args),
        launch.run_checkpoint(args),
        functools.partial(launch.cluster_config, args),
    )
