"""No request lost, measured: concurrent streaming completions through an injected fault +
retry and a SIGKILLed rank + scale-down on a real ``ftengine serve``, with token-level
re-inference on and off side by side (requests lost, tokens mismatched / repeated / missing,
extra latency of the requests in flight at the fault); with ``--vllm-checkpoint`` the same
for real vLLM's retry. Prints one JSON object."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ftengine.cli.options import at_least, options_from_args
from ftengine.testbed.cli import launch
from ftengine.testbed.cli.extras import testbed_extra

BENCH = "inflight"


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``bench inflight``'s flags."""
    parser.add_argument("--json", action="store_true", help="one line of JSON (else indented)")
    parser.add_argument("--dp-size", type=at_least(2), default=4, help="DP = EP ranks")
    parser.add_argument("--tokens", type=at_least(4), default=40, help="tokens per request")
    parser.add_argument(
        "--fault-step",
        type=at_least(1),
        default=20,
        help="rank 1's model step that raises, counted from the server's start (warm-up "
        "included); late enough that every stream was admitted (requests that come while the "
        "cluster is faulted are refused with 503)",
    )
    parser.add_argument(
        "--op-timeout", type=float, default=2.0, help="seconds before a hung collective raises"
    )
    parser.add_argument(
        "--stream-timeout", type=float, default=150.0, help="seconds each stream may take"
    )
    parser.add_argument(
        "--vllm-checkpoint",
        type=Path,
        default=None,
        help="a Hugging Face Qwen3-MoE directory: adds real vLLM's retry rows (DP=2, "
        "two deployments of ~4 GB, one at a time); without it they say 'not measured'",
    )
    parser.add_argument(
        "--vllm-port", type=int, default=8720, help="vLLM rank r serves on PORT + r"
    )
    parser.add_argument(
        "--vllm-log-dir",
        type=Path,
        default=Path("vllm-bench-logs/inflight"),
        help="each vLLM row's rank logs go to DIR/ROW-MODE (kept after the run)",
    )
    launch.add_cpu_wait_arg(parser)
    launch.add_checkpoint_args(parser, launch.CheckpointSize())
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (``ftengine.testbed.bench.inflight``) and print its JSON object."""
    with testbed_extra(f"bench {BENCH}"):
        from ftengine.testbed.bench.inflight import InflightOptions, run_inflight

    with launch.run_checkpoint(args) as checkpoint:
        result = run_inflight(options_from_args(InflightOptions, args), checkpoint)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
