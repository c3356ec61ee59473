"""The model ``ftengine serve`` offers on its OpenAI routes: its name, its limits and, when
the checkpoint has one, its tokenizer.

The tokenizer is the seam for text prompts: today it is read from the checkpoint's
``tokenizer.json`` here; once the cluster tokenises itself, pass the cluster's tokenizer
to :class:`ServedModel` instead and nothing else changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from ftengine.errors import ConfigError
from ftengine.testbed.cluster import prompts
from ftengine.testbed.control.protocol import Tokenizer
from ftengine.testbed.model_limits import ModelLimits
from ftengine.weights.tokenizer_gen import TOKENIZER_NAME

logger = logging.getLogger(__name__)

TOKENIZER_FILE = TOKENIZER_NAME


class HfTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` behind the :class:`Tokenizer` protocol."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=True).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))


def load_tokenizer(checkpoint: Path) -> tuple[Tokenizer | None, str]:
    """The checkpoint's tokenizer, or None and why there is none (for the 400 that
    refuses a text prompt). Loaded by the cluster's own loader, so the API and the cluster
    read the same file the same way."""
    path = checkpoint / TOKENIZER_FILE
    if not path.is_file():
        return None, f"the checkpoint has no {TOKENIZER_FILE}"
    try:
        return HfTokenizer(prompts.load_tokenizer(checkpoint)), f"{path}"
    except ConfigError as exc:
        logger.warning("%s", exc)
        return None, str(exc)


@attrs.frozen
class ServedModel:
    """``name`` (what clients put in ``model``), ``root`` (the checkpoint path, shown as
    ``root`` in ``/v1/models``), ``limits``, and the tokenizer (None: token-id prompts
    only; ``tokenizer_note`` says why)."""

    name: str
    root: str
    limits: ModelLimits
    tokenizer: Tokenizer | None = None
    tokenizer_note: str = "no tokenizer"
    created: int = attrs.field(factory=lambda: int(time.time()))

    @classmethod
    def from_checkpoint(cls, checkpoint: Path, name: str | None = None) -> ServedModel:
        """Read a checkpoint's limits and tokenizer; ``name`` defaults to its path, as
        vLLM's served model name defaults to the model path it was given."""
        tokenizer, note = load_tokenizer(checkpoint)
        return cls(
            name=name or str(checkpoint),
            root=str(checkpoint),
            limits=ModelLimits.from_checkpoint(checkpoint),
            tokenizer=tokenizer,
            tokenizer_note=note,
        )
