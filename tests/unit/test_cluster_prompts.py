"""Prompts as the cluster takes them: ids pass through, text goes through the checkpoint's
tokenizer (loaded only for text)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftengine.errors import ConfigError
from ftengine.testbed.cluster.prompts import PromptError, PromptTokenizer, load_tokenizer
from ftengine.weights.checkpoint_gen import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prompts") / "ck"
    return make_checkpoint(
        root, layers=1, experts=2, hidden=8, intermediate=4, vocab=24, heads=2, top_k=1
    )


def test_text_and_ids(checkpoint: Path) -> None:
    prompts = PromptTokenizer(checkpoint)
    assert prompts.encode([3, 1, 4]) == (3, 1, 4)
    assert prompts.encode("w3 w1  w4\n") == (3, 1, 4)
    assert prompts.encode("w3, who?") == (3, 20, 20, 20)  # unknown words and marks are <unk>
    assert prompts.encode_all(["w7", (8, 9)]) == [(7,), (8, 9)]
    assert prompts.decode([3, 1, 4, 22]) == "w3 w1 w4"  # </s> left out


def test_text_without_tokens_is_refused(checkpoint: Path) -> None:
    with pytest.raises(PromptError, match="holds no token"):
        PromptTokenizer(checkpoint).encode("   ")


def test_ids_never_load_the_tokenizer(tmp_path: Path) -> None:
    prompts = PromptTokenizer(tmp_path / "no-checkpoint")
    assert prompts.encode([5, 6]) == (5, 6)
    with pytest.raises(ConfigError, match=r"no-checkpoint/tokenizer\.json: no tokenizer"):
        prompts.encode("w5")


def test_a_broken_tokenizer_names_its_file(checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "Nope"}}')
    with pytest.raises(ConfigError, match=r"tokenizer\.json: the tokenizer does not load"):
        load_tokenizer(tmp_path)
    assert load_tokenizer(checkpoint).get_vocab_size() == 24
