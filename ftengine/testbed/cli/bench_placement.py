"""Placement benchmark (61 layers x 256 experts): plan + apply and elastic_info rebuild times,
balancedness against reloads and failure-aware zero-reload fractions, each beside its target.
Prints one JSON object."""

from __future__ import annotations

import argparse

from ftengine.testbed.cli.extras import testbed_extra

BENCH = "placement"


def register(parser: argparse.ArgumentParser) -> None:
    """``bench placement`` takes no flags but ``--json`` (it always prints JSON)."""
    parser.add_argument("--json", action="store_true", help="(always JSON; kept for symmetry)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run every placement measurement (``ftengine.testbed.bench.placement``) and print the JSON."""
    with testbed_extra(f"bench {BENCH}"):
        from ftengine.testbed.bench.placement import run_placement

    return run_placement()
