"""Plan a scale-down: reloads, balance, elastic_info and failure scores for one scenario."""

from __future__ import annotations

import argparse
import json
import sys

from ftengine.cli.options import options_from_args
from ftengine.errors import FTEngineError
from ftengine.placement.evaluate import Scenario, evaluate
from ftengine.placement.initial import PLACEMENTS

COMMAND = "plan"


def register(parser: argparse.ArgumentParser) -> None:
    """Add the ``plan`` options to ``parser``."""
    parser.add_argument("--layers", type=int, default=61, help="MoE layers (default 61)")
    parser.add_argument("--experts", type=int, default=256, help="logical experts per layer")
    parser.add_argument("--ep", type=int, default=32, help="original EP world size")
    parser.add_argument("--redundant", type=int, default=32, help="redundant expert slots")
    parser.add_argument(
        "--dead", type=_rank_list, default=frozenset(), help="dead EP ranks, e.g. 3,17"
    )
    parser.add_argument("--placement", choices=sorted(PLACEMENTS), default="default")
    parser.add_argument(
        "--load", default="uniform", help="uniform | zipf | PATH (.json, .npy or .pt table)"
    )
    parser.add_argument(
        "--extra-reloads",
        type=int,
        default=0,
        help="reloads beyond the lower bound the planner may spend on balance",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the zipf load")
    parser.add_argument("--zipf-exponent", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (zipf load)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _rank_list(text: str) -> frozenset[int]:
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated EP ranks like 3,17, got {text!r}"
        ) from exc


def run(args: argparse.Namespace) -> int:
    """Evaluate the scenario; print JSON (``--json``) or ``key: value`` lines."""
    scenario = options_from_args(Scenario, args)
    try:
        report = evaluate(scenario, repeats=args.repeats).to_dict()
    except FTEngineError as exc:
        print(f"ftengine plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0
