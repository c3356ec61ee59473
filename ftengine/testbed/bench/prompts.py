"""The fixed prompts the demo and the recovery benchmark send: reproducible, and within the
checkpoint's vocabulary."""

from __future__ import annotations

import json
import random
from pathlib import Path


def fixed_prompts(count: int, vocab: int, seed: int = 1234) -> list[list[int]]:
    """``count`` reproducible prompts of 3 to 8 token ids below ``vocab``."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(3 + i % 6)] for i in range(count)]


def checkpoint_vocab(path: Path) -> int:
    """The vocabulary size in a checkpoint's ``config.json`` (prompts must stay below it)."""
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def prompts_for(checkpoint: Path, count: int) -> list[list[int]]:
    """``count`` reproducible prompts within ``checkpoint``'s vocabulary."""
    return fixed_prompts(count, checkpoint_vocab(checkpoint))
