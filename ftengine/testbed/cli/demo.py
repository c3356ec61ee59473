"""Run the main job end to end: SIGKILL one rank's worker of a DP=2 real-vLLM deployment under
traffic and watch it recover (``scale_down`` through vLLM's fault-tolerance API), answers
checked against those before the fault; ``--cluster``: the same on a DP=4 CPU cluster
against a fault-free reference. Exits 0 only if all held."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from ftengine.cli.options import options_from_args
from ftengine.testbed.cli import launch
from ftengine.testbed.cli.extras import testbed_extra

COMMAND = "demo"
DEMO_SIZE = launch.CheckpointSize(layers=2, experts=8, hidden=64, intermediate=64, vocab=256)
CLUSTER_VICTIM = 3
VLLM_VICTIM = 1
VLLM_DP = 2


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``demo``'s flags."""
    parser.add_argument(
        "--cluster", action="store_true", help="run on ftengine's DP=4 CPU cluster, not vLLM"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument(
        "--victim",
        type=int,
        default=None,
        help=f"DP rank to SIGKILL (default {VLLM_VICTIM}; {CLUSTER_VICTIM} with --cluster)",
    )
    parser.add_argument("--prompts", type=int, default=4, help="number of fixed prompts")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per prompt")
    parser.add_argument(
        "--plain", action="store_true", help="timestamped lines instead of a live table"
    )
    parser.add_argument(
        "--plot", type=Path, default=None, help="vLLM: write a completions/s PNG here"
    )
    parser.add_argument("--port", type=int, default=8790,
                        help="vLLM: rank r serves HTTP on PORT + r")  # fmt: skip
    parser.add_argument("--log-dir", type=Path, default=Path("vllm-demo-logs"),
                        help="vLLM: each rank's server log goes here")  # fmt: skip
    launch.add_run_args(parser, DEMO_SIZE)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the vLLM demo (``ftengine.testbed.vllm.demo``), or with ``--cluster`` the
    CPU-cluster one (``ftengine.testbed.bench.demo``) on the checkpoint and cluster the flags
    name."""
    if not args.cluster:
        return _run_vllm(args)
    with testbed_extra(COMMAND):
        from ftengine.testbed.bench.demo import DemoOptions, run_demo

    victim = CLUSTER_VICTIM if args.victim is None else args.victim
    return run_demo(
        options_from_args(DemoOptions, args, victim=victim),
        launch.run_checkpoint(args),
        functools.partial(launch.cluster_config, args),
    )


def _run_vllm(args: argparse.Namespace) -> int:
    with testbed_extra(COMMAND):
        from ftengine.testbed.vllm.demo import VllmDemoOptions, run_vllm_demo

    victim = VLLM_VICTIM if args.victim is None else args.victim
    # DP=2 whatever --dp-size says: a vLLM rank costs ~1.9 GB and 25-50 s to start here.
    options = options_from_args(VllmDemoOptions, args, victim=victim, dp_size=VLLM_DP)
    return run_vllm_demo(options)
