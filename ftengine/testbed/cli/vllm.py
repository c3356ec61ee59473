"""Real vLLM with ftengine in every worker: ``ftengine vllm up`` starts an external-LB
deployment (one OpenAI server per DP rank) and stops all of it on exit or Ctrl-C."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from ftengine.backends.npu_config import PLACEMENTS
from ftengine.errors import ConfigError

if TYPE_CHECKING:
    from ftengine.testbed.vllm.launcher import DeploymentConfig

COMMAND = "vllm"


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``vllm up`` and its flags."""
    actions = parser.add_subparsers(dest="vllm_action", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="start a DP+EP deployment and serve until Ctrl-C")
    up.add_argument("--dp", type=int, default=2, help="data-parallel ranks (default 2)")
    up.add_argument("--checkpoint", type=Path, required=True, help="HF checkpoint directory")
    up.add_argument("--port", type=int, default=8000, help="rank r serves on PORT + r")
    up.add_argument("--host", default="127.0.0.1", help="bind address of every server")
    up.add_argument(
        "--hosts",
        type=int,
        default=None,
        help="spread the ranks evenly over N network-namespace hosts on a bridge (root; "
        "each rank's server binds its host's address; --host is then unused)",
    )
    up.add_argument(
        "--layout",
        default=None,
        help="ranks per namespace host, e.g. 1,2,1 (sums to --dp; instead of --hosts)",
    )
    up.add_argument(
        "--policy", default=None, help="ftengine policy: orchestrator, auto or module:factory"
    )
    up.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default=None,
        help="ftengine placement: failure-aware loads standby expert copies at start-up, so "
        "that a one-rank scale-down reloads nothing (default: vLLM's, survivors reload)",
    )
    up.add_argument(
        "--no-reinference",
        action="store_true",
        help="abort in-flight requests at a fault, as vLLM does (ftengine.reinference: false; "
        "by default they are held and resumed, a dead rank's on a survivor)",
    )
    up.add_argument(
        "--handoff",
        action="store_true",
        help="name the other ranks' servers as each rank's ftengine.handoff_urls (by default "
        "a rank whose worker died finds them on vLLM's DP store)",
    )
    up.add_argument(
        "--additional-config",
        default=None,
        help="vLLM's --additional-config JSON (ftengine's options under \"ftengine\")",
    )
    up.add_argument(
        "--recovery-timeout", type=float, default=120.0, help="engine_recovery_timeout_sec"
    )
    up.add_argument(
        "--dtype", default="auto", help="vLLM's --dtype: auto (the checkpoint's), float32, ..."
    )
    up.add_argument("--no-fault-tolerance", action="store_true", help="without FT (baseline)")
    up.add_argument("--log-dir", type=Path, default=Path("vllm-logs"), help="rank{r}.log here")
    up.add_argument(
        "vllm_args", nargs=argparse.REMAINDER, help="after --: passed to every vLLM server"
    )
    up.set_defaults(func=run_up)


def _additional(args: argparse.Namespace) -> dict[str, object]:
    raw = args.additional_config
    try:
        additional = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--additional-config must be JSON, found {raw!r}: {exc}") from exc
    if not isinstance(additional, dict):
        raise ConfigError(f"--additional-config must be a JSON object, found {raw!r}")
    options = {
        "policy": args.policy,
        "placement": args.placement,
        "reinference": False if args.no_reinference else None,
    }
    given = {key: value for key, value in options.items() if value is not None}
    if given:
        sub = additional.setdefault("ftengine", {})
        if not isinstance(sub, dict):
            raise ConfigError(f"--additional-config's ftengine must be an object, found {sub!r}")
        sub.update(given)
    return additional


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the deployment's __exit__


def run_up(args: argparse.Namespace) -> int:
    """Check the flags, start every rank, print URLs and pids, wait for Ctrl-C / SIGTERM."""
    from ftengine.testbed.vllm.launcher import (
        DeploymentConfig,
        DeploymentFailed,
        VllmDeployment,
        format_ranks,
    )

    extra = [a for a in args.vllm_args if a != "--"]
    try:
        config = DeploymentConfig(
            args.checkpoint,
            dp_size=args.dp,
            port=args.port,
            host=args.host,
            fault_tolerance=not args.no_fault_tolerance,
            recovery_timeout_s=args.recovery_timeout,
            dtype=args.dtype,
            additional_config=_additional(args),
            extra_args=tuple(extra),
            log_dir=args.log_dir,
            handoff=args.handoff,
        )
    except ConfigError as exc:
        print(f"ftengine vllm up: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop)
    if args.hosts is not None or args.layout is not None:
        return _run_hosts(args, config)
    try:
        with VllmDeployment.start(config) as deployment:
            for line in format_ranks(deployment):
                print(line, flush=True)
            print("serving; Ctrl-C stops every process above", flush=True)
            threading.Event().wait()
    except (ConfigError, DeploymentFailed) as exc:
        print(f"ftengine vllm up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _run_hosts(args: argparse.Namespace, config: DeploymentConfig) -> int:
    """``vllm up --hosts N`` / ``--layout``: the same deployment over namespace hosts."""
    from ftengine.testbed.vllm.hosts import HostLayout, MultiHostDeployment
    from ftengine.testbed.vllm.launcher import DeploymentFailed

    try:
        layout = (
            HostLayout.parse(args.layout)
            if args.layout is not None
            else HostLayout.even(args.dp, args.hosts)
        )
        with MultiHostDeployment.start(config, layout) as spread:
            for line in spread.describe():
                print(line, flush=True)
            print("serving; Ctrl-C stops every process and removes every host above", flush=True)
            threading.Event().wait()
    except (ConfigError, DeploymentFailed) as exc:
        print(f"ftengine vllm up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
