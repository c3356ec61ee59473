"""Write a Hugging Face Qwen3-MoE checkpoint: config, sharded safetensors, tokenizer (for tests,
benchmarks and the demo; transformers and vLLM load it as it is)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from ftengine.errors import FTEngineError
from ftengine.testbed.cli.extras import missing_extra
from ftengine.weights.checkpoint_gen import make_checkpoint
from ftengine.weights.index import CheckpointIndex, Quant

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

COMMAND = "make-checkpoint"

ProgressFn = Callable[[int, int], None]
PhaseProgress = Callable[[str, int, int], None]


@contextmanager
def phase_progress(enabled: bool) -> Iterator[PhaseProgress | None]:
    """A rich progress bar on stderr, one row per phase, fed (phase, bytes done, bytes total).

    Yields None when not ``enabled`` (callers pass ``sys.stderr.isatty()``), and when rich
    is not installed: it comes with the ``testbed`` extra, and ``make-checkpoint`` does its
    whole job without a bar.
    """
    try:
        bar = _progress_bar() if enabled else None
    except ModuleNotFoundError as exc:
        if missing_extra(exc) is None:
            raise
        bar = None
    if bar is None:
        yield None
        return
    with bar as live:
        tasks: dict[str, TaskID] = {}

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = live.add_task(phase, total=total)
            live.update(tasks[phase], completed=done, total=total)

        yield update


def _progress_bar() -> Progress:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description:<20}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=Console(stderr=True), transient=True)


@contextmanager
def byte_progress(description: str) -> Iterator[ProgressFn | None]:
    """A single-row ``phase_progress`` on a terminal (None otherwise), fed (done, total)."""
    with phase_progress(sys.stderr.isatty()) as phases:
        if phases is None:
            yield None
            return

        def update(done: int, total: int) -> None:
            phases(description, done, total)

        yield update


def register(parser: argparse.ArgumentParser) -> None:
    """Add the make-checkpoint arguments (sizes default to a model of about 1 MB)."""
    parser.add_argument("path", type=Path, help="directory to write (created if missing)")
    parser.add_argument("--layers", type=int, default=2, help="MoE decoder layers")
    parser.add_argument("--experts", type=int, default=8, help="logical experts per layer")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size H")
    parser.add_argument("--intermediate", type=int, default=32, help="expert intermediate I")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--quant", choices=get_args(Quant), default="none")
    parser.add_argument("--shards", type=int, default=2, help="number of safetensors files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--fused-gate-up", action="store_true", help="write gate_up_proj")
    parser.add_argument(
        "--tie-word-embeddings", action="store_true", help="no lm_head: the head is the embedding"
    )
    parser.add_argument(
        "--norm-topk-prob",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="renormalise the router's top-k weights (default: on)",
    )
    parser.add_argument("--rope-theta", type=float, default=1000000.0, help="rotary base")
    parser.add_argument("--manifest", action="store_true", help="write a sha256 manifest")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing one")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the checkpoint and print one JSON summary line (path, files, sizes)."""
    try:
        with byte_progress("writing checkpoint") as progress:
            root = make_checkpoint(
                args.path,
                layers=args.layers,
                experts=args.experts,
                hidden=args.hidden,
                intermediate=args.intermediate,
                dtype=args.dtype,
                quant=args.quant,
                shards=args.shards,
                seed=args.seed,
                vocab=args.vocab,
                heads=args.heads,
                kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                top_k=args.top_k,
                fused_gate_up=args.fused_gate_up,
                tie_word_embeddings=args.tie_word_embeddings,
                norm_topk_prob=args.norm_topk_prob,
                rope_theta=args.rope_theta,
                manifest=args.manifest,
                overwrite=args.overwrite,
                progress=progress,
            )
        index = CheckpointIndex.open(root)
    except FTEngineError as exc:
        print(f"ftengine make-checkpoint: {exc}", file=sys.stderr)
        return 2
    summary = {
        "path": str(root),
        "files": len(index.files),
        "tensors": len(index.tensors),
        "total_bytes": sum(header.data_end for header in index.files.values()),
        "expert_bytes": index.expert_bytes_total,
        "quant": index.quant,
    }
    print(json.dumps(summary))
    return 0
