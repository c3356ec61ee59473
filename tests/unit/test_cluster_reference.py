"""The single-process reference run and the outputs check the e2e tests rely on."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftengine.testbed.cluster import LOGITS_ATOL, Generation, compare_outputs, reference_generate
from ftengine.testbed.cluster.handles import describe_exit
from tests.gloo_support import tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ref") / "ckpt")


def test_reference_is_deterministic_and_shaped(checkpoint: Path) -> None:
    prompts = [[1, 2, 3], [4, 5]]
    first = reference_generate(checkpoint, prompts, 4)
    again = reference_generate(checkpoint, prompts[::-1], 4)[::-1]
    assert [len(g.token_ids) for g in first] == [4, 4]
    assert all(len(g.final_logits) == 32 for g in first)
    # The last token is the argmax of the final logits (greedy).
    for g in first:
        assert g.token_ids[-1] == max(range(32), key=g.final_logits.__getitem__)
    assert compare_outputs(again, first).max_logit_diff == 0.0


def test_compare_outputs_flags_token_and_logit_differences() -> None:
    base = Generation((1, 2), (0.0, 1.0))
    assert compare_outputs([base], [base]).match
    tokens = compare_outputs([Generation((1, 3), (0.0, 1.0))], [base])
    assert not tokens.match and tokens.token_mismatches == (0,)
    close = compare_outputs([Generation((1, 2), (0.0, 1.0 + LOGITS_ATOL / 2))], [base])
    assert close.match
    far = compare_outputs([Generation((1, 2), (0.0, 1.1))], [base])
    assert not far.match and far.max_logit_diff == pytest.approx(0.1)
    assert not compare_outputs([], [base]).match


def test_describe_exit() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(None) == "still running"
