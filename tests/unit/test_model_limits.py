"""The model limits every request is checked against: read from config.json (and
generation_config.json), and the one rule the API edge and the worker share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftengine.errors import ConfigError
from ftengine.testbed.model_limits import DEFAULT_MAX_POSITIONS, ModelLimits


def test_reads_vocab_context_and_both_eos_sources(tmp_path: Path) -> None:
    config = {"vocab_size": 512, "max_position_embeddings": 4096, "eos_token_id": 7}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelLimits.from_checkpoint(tmp_path) == ModelLimits(512, 4096, frozenset({7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ModelLimits.from_checkpoint(tmp_path).eos_token_ids == {7, 9}


def test_defaults_when_the_config_is_silent() -> None:
    limits = ModelLimits.from_config({"vocab_size": 10})
    assert limits == ModelLimits(10, DEFAULT_MAX_POSITIONS, frozenset())


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({}, "vocab_size"),
        ({"vocab_size": "many"}, "vocab_size"),
        ({"vocab_size": 0}, "vocab_size must be an int >= 1"),
        ({"vocab_size": 8, "eos_token_id": "x"}, "eos_token_id"),
        ({"vocab_size": 8, "eos_token_id": [1, True]}, "eos_token_id"),
    ],
)
def test_a_bad_config_names_the_key(config: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ModelLimits.from_config(config)


def test_a_missing_config_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json"):
        ModelLimits.from_checkpoint(tmp_path)


def test_out_of_vocab_finds_the_first_offender() -> None:
    limits = ModelLimits(512, 64)
    assert limits.out_of_vocab([1, 2, 511]) is None
    assert limits.out_of_vocab([1, 2, 99999, -1]) == 99999
    assert limits.out_of_vocab([-1]) == -1


@pytest.mark.parametrize(
    ("cached", "tokens", "needle"),
    [
        (0, [], "at least one token"),
        (0, [1, 2, 99999], "token id 99999 is outside the vocabulary (ids 0..511)"),
        (60, [1, 2, 3, 4, 5], "60 cached + 5 new tokens exceed the model's context of 64"),
    ],
)
def test_item_problem_says_what_is_wrong(cached: int, tokens: list[int], needle: str) -> None:
    problem = ModelLimits(512, 64).item_problem(cached, tokens)
    assert problem is not None and needle in problem


def test_item_problem_is_none_up_to_the_last_position() -> None:
    limits = ModelLimits(512, 64)
    assert limits.item_problem(0, [0, 511]) is None
    assert limits.item_problem(63, [5]) is None
