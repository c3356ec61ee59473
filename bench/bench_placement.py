"""Placement benchmark; prints one JSON object (same as ``ftengine bench placement``).

Usage: ``python bench/bench_placement.py`` (a minute or two on 2 busy cores); each target is
``{"value", "target", "met"}`` and ``environment`` says how busy the host was.
"""

from __future__ import annotations

import sys

from ftengine.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "placement", "--json", *sys.argv[1:]]))
