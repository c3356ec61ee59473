"""Shared command-line plumbing for ``serve``, ``demo`` and ``bench recovery``: checkpoint
size flags, cluster flags, making (or reusing) a checkpoint and building a ClusterConfig.
The commands use :func:`add_run_args`, :func:`run_checkpoint` and :func:`cluster_config`.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import attrs

if TYPE_CHECKING:
    from ftengine.testbed.cluster.config import ClusterConfig

Quant = Literal["none", "w8a8_dynamic"]


@attrs.frozen
class CheckpointSize:
    """Sizes of a generated checkpoint (see ``ftengine.weights.checkpoint_gen``)."""

    layers: int = 2
    experts: int = 8
    hidden: int = 64
    intermediate: int = 64
    vocab: int = 256
    quant: Quant = "none"
    dtype: str = "bfloat16"
    seed: int = 0


def add_checkpoint_args(parser: argparse.ArgumentParser, size: CheckpointSize) -> None:
    """``--checkpoint`` (reuse or create there) and the size flags, defaulting to ``size``."""
    group = parser.add_argument_group("checkpoint")
    group.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="checkpoint directory: reused if it holds config.json, else generated there "
        "(default: a temporary directory, removed at exit)",
    )
    group.add_argument("--layers", type=int, default=size.layers, help="MoE layers")
    group.add_argument("--experts", type=int, default=size.experts, help="logical experts")
    group.add_argument("--hidden", type=int, default=size.hidden, help="hidden size")
    group.add_argument(
        "--intermediate", type=int, default=size.intermediate, help="expert intermediate size"
    )
    group.add_argument("--vocab", type=int, default=size.vocab, help="vocabulary size")
    group.add_argument("--quant", choices=("none", "w8a8_dynamic"), default=size.quant)
    group.add_argument("--seed", type=int, default=size.seed, help="weight seed")


def add_cluster_args(parser: argparse.ArgumentParser, *, policy: str = "orchestrator") -> None:
    """Cluster flags: DP size, recovery policy, timeouts and fault injection."""
    group = parser.add_argument_group("cluster")
    group.add_argument("--dp-size", type=int, default=4, help="DP = EP ranks (worker processes)")
    group.add_argument(
        "--policy",
        default=policy,
        help="orchestrator: wait for commands (vLLM); auto: recover without commands; "
        "package.module:factory: your policy (imported and checked at start-up)",
    )
    group.add_argument(
        "--op-timeout", type=float, default=2.0, help="seconds before a hung collective raises"
    )
    group.add_argument("--heartbeat", type=float, default=0.25, help="heartbeat period, seconds")
    group.add_argument(
        "--recovery-timeout",
        type=float,
        default=120.0,
        help="seconds an UNHEALTHY engine waits for a command before it is DEAD",
    )
    group.add_argument(
        "--max-reinference",
        type=int,
        default=3,
        help="re-runs of one request after faults before it is aborted (token re-inference)",
    )
    group.add_argument(
        "--no-reinference",
        action="store_true",
        help="a fault aborts every in-flight request instead of holding and resuming it",
    )
    group.add_argument(
        "--inject-fault",
        default=None,
        metavar="SPEC",
        help="e.g. 'rank=3,step=50,kind=raise|hang|kill|reload_error' (FTENGINE_INJECT_FAULT)",
    )


def add_cpu_wait_arg(parser: argparse.ArgumentParser) -> None:
    """``--cpu-wait {yield,nap}`` (default ``yield``) for a bench that launches real vLLM."""
    from ftengine.testbed.vllm.cpu_wait import CPU_WAITS

    parser.add_argument(
        "--cpu-wait",
        choices=CPU_WAITS,
        default=CPU_WAITS[0],
        help="vllm: how vLLM's queue waits give up the CPU: yield (vLLM's own) or nap (for "
        "more busy processes than cores: ftengine.testbed.vllm.cpu_wait)",
    )


def add_run_args(
    parser: argparse.ArgumentParser, size: CheckpointSize, *, policy: str = "orchestrator"
) -> None:
    """Every flag a command that runs a cluster takes: checkpoint (sizes default to ``size``)
    and cluster (``--policy`` defaults to ``policy``)."""
    add_checkpoint_args(parser, size)
    add_cluster_args(parser, policy=policy)


def size_from_args(args: argparse.Namespace) -> CheckpointSize:
    """The ``CheckpointSize`` named by the parsed size flags."""
    return CheckpointSize(
        layers=args.layers,
        experts=args.experts,
        hidden=args.hidden,
        intermediate=args.intermediate,
        vocab=args.vocab,
        quant="w8a8_dynamic" if args.quant == "w8a8_dynamic" else "none",
        seed=args.seed,
    )


def make_checkpoint_at(path: Path, size: CheckpointSize) -> Path:
    """Generate a checkpoint of ``size`` in ``path`` (created if missing)."""
    from ftengine.weights.checkpoint_gen import make_checkpoint

    return make_checkpoint(
        path,
        layers=size.layers,
        experts=size.experts,
        hidden=size.hidden,
        intermediate=size.intermediate,
        dtype=size.dtype,
        quant=size.quant,
        seed=size.seed,
        vocab=size.vocab,
    )


@contextlib.contextmanager
def checkpoint_dir(path: Path | None, size: CheckpointSize) -> Iterator[Path]:
    """Yield a checkpoint directory: ``path`` reused when it holds one, else generated.

    With ``path`` None the checkpoint goes to a temporary directory removed on exit.
    """
    if path is not None:
        if not (path / "config.json").is_file():
            make_checkpoint_at(path, size)
        yield path
        return
    scratch = Path(tempfile.mkdtemp(prefix="ftengine-ckpt-"))
    try:
        yield make_checkpoint_at(scratch / "model", size)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_checkpoint(args: argparse.Namespace) -> contextlib.AbstractContextManager[Path]:
    """The checkpoint the parsed flags name (``--checkpoint`` and the size flags), as
    :func:`checkpoint_dir` yields it."""
    return checkpoint_dir(args.checkpoint, size_from_args(args))


def cluster_config(
    args: argparse.Namespace, checkpoint: Path, **overrides: object
) -> ClusterConfig:
    """A ``ClusterConfig`` from the parsed cluster flags (``overrides`` win)."""
    from ftengine.testbed.cluster.config import ClusterConfig

    fields: dict[str, object] = {
        "checkpoint": checkpoint,
        "dp_size": args.dp_size,
        "policy": args.policy,
        "op_timeout_s": args.op_timeout,
        "heartbeat_s": args.heartbeat,
        "recovery_timeout_s": args.recovery_timeout,
        "inject_fault": args.inject_fault,
        "reinference": not args.no_reinference,
        "max_reinference": args.max_reinference,
    }
    fields.update(overrides)
    return ClusterConfig(**fields)  # type: ignore[arg-type]
