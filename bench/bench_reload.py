"""Selective expert reload benchmark; prints one JSON object (same as ``ftengine bench reload``).

Usage: ``python bench/bench_reload.py [--size-mb 1024] [--quant none|w8a8_dynamic] ...``
"""

from __future__ import annotations

import sys

from ftengine.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "reload", "--json", *sys.argv[1:]]))
