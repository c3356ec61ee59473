"""The generated checkpoint's tokenizer: a word-level vocabulary made locally with the
``tokenizers`` library, saved as ``tokenizer.json`` + ``tokenizer_config.json`` so that
transformers' ``AutoTokenizer`` and vLLM load it with no network and no other file.

Word ``w{i}`` is token id ``i`` (so the text ``"w1 w2 w3"`` is the prompt ``[1, 2, 3]``);
the special tokens take the last ids of the vocabulary, as Qwen's do, so that small ids
stay plain words. Text splits on whitespace and punctuation; an unknown word is ``<unk>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ftengine.errors import ConfigError

TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"

SPECIAL_TOKENS = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}
"""Role -> token text; the roles take the vocabulary's last ids in this order."""

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
"""A plain template (contents joined by spaces) so that chat endpoints accept the model."""


def word(token_id: int) -> str:
    """The vocabulary word of a non-special token id."""
    return f"w{token_id}"


def check_vocab(vocab: int) -> None:
    """ConfigError unless ``vocab`` leaves room for a word beside the special tokens."""
    if vocab <= len(SPECIAL_TOKENS):
        raise ConfigError(
            f"vocab must be above the {len(SPECIAL_TOKENS)} special tokens "
            f"{list(SPECIAL_TOKENS.values())}, found {vocab}"
        )


def special_token_ids(vocab: int) -> dict[str, int]:
    """Role -> id of every special token in a vocabulary of ``vocab`` ids."""
    first = vocab - len(SPECIAL_TOKENS)
    return {role: first + offset for offset, role in enumerate(SPECIAL_TOKENS)}


def build_tokenizer(vocab: int) -> Tokenizer:
    """The word-level tokenizer of ``vocab`` ids (ConfigError if ``check_vocab`` refuses it)."""
    check_vocab(vocab)
    ids = special_token_ids(vocab)
    table = {word(i): i for i in range(vocab - len(SPECIAL_TOKENS))}
    table.update({SPECIAL_TOKENS[role]: token_id for role, token_id in ids.items()})
    tokenizer = Tokenizer(models.WordLevel(table, unk_token=SPECIAL_TOKENS["unk"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # Word-level pieces are whole words: decoding joins them with single spaces.
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS.values()))
    return tokenizer


def tokenizer_config(vocab: int, max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` content for the tokenizer of ``vocab`` ids."""
    ids = special_token_ids(vocab)
    added = {
        str(ids[role]): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for role, text in SPECIAL_TOKENS.items()
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        **{f"{role}_token": text for role, text in SPECIAL_TOKENS.items()},
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(root: Path, vocab: int, max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into checkpoint ``root``."""
    build_tokenizer(vocab).save(str(root / TOKENIZER_NAME))
    config = tokenizer_config(vocab, max_length)
    (root / TOKENIZER_CONFIG_NAME).write_text(json.dumps(config, indent=2))
