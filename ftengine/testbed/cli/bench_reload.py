"""Benchmark selective expert reload against the naive load-everything baseline and a raw read.

By default every timed run starts from a cold page cache (the shards evicted, as after a
real fault), with a warm-cache measurement reported beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from ftengine.cli.options import options_from_args
from ftengine.errors import FTEngineError
from ftengine.testbed.cli.checkpoint import phase_progress
from ftengine.testbed.cli.extras import testbed_extra
from ftengine.weights.checkpoint_gen import is_generated_checkpoint, remove_checkpoint
from ftengine.weights.index import Quant

if TYPE_CHECKING:
    from rich.table import Table

    from ftengine.testbed.bench.reload_measure import Cache

BENCH = "reload"


def default_checkpoint(size_mb: float, quant: str) -> Path:
    """Where the benchmark keeps (and reuses) its checkpoint: under the temp dir, never the repo."""
    return Path(tempfile.gettempdir()) / "ftengine-bench-reload" / f"{size_mb:g}mb-{quant}"


def register(parser: argparse.ArgumentParser) -> None:
    """Add the bench-reload arguments."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--size-mb", type=float, default=1024.0, help="expert bytes, about")
    parser.add_argument("--quant", choices=get_args(Quant), default="none")
    parser.add_argument("--checkpoint", type=Path, default=None, help="build or reuse here")
    parser.add_argument("--remove", action="store_true", help="delete the checkpoint after")
    parser.add_argument("--dp", type=int, default=4, help="DP = EP ranks")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64, help="logical experts per layer")
    parser.add_argument("--redundant", type=int, default=32, help="redundant expert slots")
    parser.add_argument("--dead-rank", type=int, default=1)
    parser.add_argument(
        "--worker-rank", type=int, default=None, help="the survivor measured (default: busiest)"
    )
    parser.add_argument("--workers", type=int, default=1, help="reload thread pool size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per child")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5, help="timed runs; the best counts")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--warm", action="store_true", help="measure from a warm page cache only (no eviction)"
    )
    cache.add_argument("--cold-only", action="store_true", help="skip the warm-cache comparison")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child")
    parser.set_defaults(func=run)


def _table(result: dict[str, Any]) -> Table:
    from rich.table import Table

    table = Table(title="selective expert reload")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if isinstance(value, dict):
            for sub, item in value.items():
                table.add_row(f"{key}.{sub}", str(item))
        else:
            table.add_row(key, str(value))
    return table


def _caches(args: argparse.Namespace) -> tuple[Cache, ...]:
    """Cold first (the headline, as after a real fault), then warm for comparison."""
    if args.warm:
        return ("warm",)
    return ("cold",) if args.cold_only else ("cold", "warm")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (``ftengine.testbed.bench.reload``); print JSON (``--json``) or a table.
    Exit 0 even if a target is missed."""
    with testbed_extra(f"bench {BENCH}"):
        from rich.console import Console

        from ftengine.testbed.bench.reload import BenchSetup, run_bench

    setup = options_from_args(BenchSetup, args, repeat=max(1, args.repeat), caches=_caches(args))
    root = args.checkpoint or default_checkpoint(args.size_mb, args.quant)
    try:
        with phase_progress(sys.stderr.isatty()) as progress:
            result = run_bench(setup, root, timeout_s=args.timeout, progress=progress)
    except FTEngineError as exc:
        print(f"ftengine bench reload: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.remove and is_generated_checkpoint(root):
            remove_checkpoint(root)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        Console().print(_table(result))
    return 0
