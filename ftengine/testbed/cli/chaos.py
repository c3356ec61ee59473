"""Chaos campaign on the CPU cluster: a seeded plan of faults (SIGKILL, SIGSTOP, step
exceptions, reload errors, broken shards, two ranks, rank 0) under concurrent streaming
traffic, recovery driven over HTTP, invariants checked after every fault; prints progress
to stderr and one JSON object (exit 1 when an invariant was violated)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from ftengine.cli.options import at_least
from ftengine.testbed.cli import launch
from ftengine.testbed.cli.extras import testbed_extra

COMMAND = "chaos"
CHAOS_SIZE = launch.CheckpointSize(layers=2, experts=8, hidden=64, intermediate=32)


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``chaos``'s flags."""
    parser.add_argument("--faults", type=at_least(1), default=20, help="faults to inject")
    parser.add_argument(
        "--seed", type=int, default=0, help="the plan's seed (same seed, same plan)"
    )
    parser.add_argument(
        "--only",
        type=_only,
        default=None,
        help="run only these fault numbers of the --faults plan (29,30,36 or 24-40): "
        "replays a reported fault without the ones before it",
    )
    parser.add_argument("--json", action="store_true", help="(always JSON; kept for symmetry)")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the timings here")
    parser.add_argument("--clients", type=at_least(1), default=6, help="concurrent streams")
    parser.add_argument("--max-tokens", type=at_least(1), default=24, help="tokens per stream")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    # Not add_checkpoint_args: its --seed is the weight seed, and --seed here is the plan's.
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="checkpoint directory: reused if it holds config.json, else generated there "
        "(a small one: 2 layers, 8 experts; default: a temporary directory)",
    )
    group = parser.add_argument_group("cluster")
    group.add_argument("--dp-size", type=at_least(2), default=4, help="DP = EP ranks")
    group.add_argument("--policy", choices=("orchestrator", "auto"), default="orchestrator")
    group.add_argument(
        "--netns",
        action="store_true",
        help="each worker in its own network namespace on a bridge made for the run (root): "
        "adds the network cut to the faults",
    )
    group.add_argument("--op-timeout", type=float, default=2.0, help="per-op timeout, seconds")
    group.add_argument(
        "--no-rejoin",
        action="store_true",
        help="leave removed ranks out (the cluster shrinks until a rebuild) instead of "
        "restarting them and admitting them back with scale_up after each fault",
    )
    parser.set_defaults(func=run)


def _only(text: str) -> tuple[int, ...]:
    from ftengine.testbed.chaos.catalogue import parse_only

    try:
        return parse_only(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    """Run the campaign and print its JSON object."""
    with testbed_extra(COMMAND):
        from ftengine.testbed.chaos.cluster_options import ClusterCampaignOptions
        from ftengine.testbed.chaos.cluster_target import ClusterTarget
        from ftengine.testbed.chaos.run import run_campaign

        if args.plot is not None:
            # matplotlib is imported only to draw, after every fault: check it first.
            importlib.import_module("matplotlib")

    options = ClusterCampaignOptions(
        faults=args.faults, seed=args.seed, policy=args.policy, dp_size=args.dp_size,
        clients=args.clients, max_tokens=args.max_tokens, op_timeout_s=args.op_timeout,
        netns=args.netns, only=args.only, rejoin=not args.no_rejoin,
    )  # fmt: skip

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"chaos {time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)

    with launch.checkpoint_dir(args.checkpoint, CHAOS_SIZE) as checkpoint:
        report = run_campaign(
            ClusterTarget(options, checkpoint, progress), progress, plot=args.plot
        )
    print(json.dumps(report, indent=2))
    return 1 if report["violations"] else 0
