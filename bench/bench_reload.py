"""Selective expert reload benchmark; prints one JSON object (same as ``ftengine bench reload``).

Usage: ``python bench/bench_reload.py [--size-mb 1024] [--quant none|w8a8_dynamic] ...``;
cold page cache by default (shards evicted before each timed run) with the warm numbers
beside; ``--warm`` measures warm only, ``--cold-only`` skips the warm comparison.
"""

from __future__ import annotations

import sys

from ftengine.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "reload", "--json", *sys.argv[1:]]))
