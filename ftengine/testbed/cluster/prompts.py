"""Prompts as the cluster takes them: token ids pass through as they are, text is tokenised
with the checkpoint's own ``tokenizer.json`` (the file transformers and vLLM use).

Encoding adds the tokenizer's special tokens as transformers' ``tokenizer(text)`` and vLLM
do (the generated word-level tokenizer adds none), so a text prompt becomes the same ids
in all three.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from ftengine.errors import ConfigError, FTEngineError
from ftengine.weights.tokenizer_gen import TOKENIZER_NAME

Prompt = str | Sequence[int]
"""Prompt text, or its token ids."""


class PromptError(FTEngineError, ValueError):
    """A prompt cannot be served (e.g. text with no tokens in it)."""


def load_tokenizer(checkpoint: str | Path) -> Tokenizer:
    """The tokenizer in ``checkpoint/tokenizer.json``; ConfigError naming the file if it
    is missing or does not load."""
    file = Path(checkpoint) / TOKENIZER_NAME
    if not file.is_file():
        raise ConfigError(
            f"{file}: no tokenizer; a checkpoint needs {TOKENIZER_NAME} (re-create it with "
            "`ftengine make-checkpoint`)"
        )
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for every parse error
        raise ConfigError(f"{file}: the tokenizer does not load ({exc})") from exc


class PromptTokenizer:
    """Turns prompts into token ids with ``checkpoint``'s tokenizer, loaded on the first
    text prompt (token-id prompts never load it)."""

    def __init__(self, checkpoint: str | Path) -> None:
        self._checkpoint = Path(checkpoint)
        self._lock = threading.Lock()
        self._tokenizer: Tokenizer | None = None

    def tokenizer(self) -> Tokenizer:
        """The loaded tokenizer (loading it now if needed)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self._checkpoint)
            return self._tokenizer

    def encode(self, prompt: Prompt) -> tuple[int, ...]:
        """``prompt``'s token ids; PromptError for text that holds no token."""
        if not isinstance(prompt, str):
            return tuple(int(token) for token in prompt)
        ids = tuple(self.tokenizer().encode(prompt, add_special_tokens=True).ids)
        if not ids:
            raise PromptError(f"prompt text {prompt!r} holds no token; pass some words")
        return ids

    def encode_all(self, prompts: Sequence[Prompt]) -> list[tuple[int, ...]]:
        """Every prompt's token ids, in order."""
        return [self.encode(prompt) for prompt in prompts]

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (special tokens left out)."""
        return str(self.tokenizer().decode(list(token_ids), skip_special_tokens=True))
