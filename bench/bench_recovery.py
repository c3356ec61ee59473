"""Recovery benchmark on the CPU cluster; prints one JSON object (same as
``ftengine bench recovery``).

Usage: ``python bench/bench_recovery.py [--plot docs/results/recovery.png] [--kill-trials 10] ...``
"""

from __future__ import annotations

import sys

from ftengine.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "recovery", "--json", *sys.argv[1:]]))
