"""Print the recovery FSM's transition table, or its mermaid state diagram (--mermaid)."""

from __future__ import annotations

import argparse

from ftengine.fsm import render_mermaid, render_table

COMMAND = "fsm"


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``fsm``'s flags."""
    parser.add_argument(
        "--mermaid",
        action="store_true",
        help="print a mermaid stateDiagram (the README's diagram) instead of the table",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the table or the diagram; both come from ``ftengine.fsm.TABLE``."""
    print(render_mermaid() if args.mermaid else render_table())
    return 0
