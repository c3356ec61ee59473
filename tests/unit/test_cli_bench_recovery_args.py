"""``ftengine bench recovery`` refuses trial and round counts it cannot measure with, before
it launches anything, and says why."""

from __future__ import annotations

import argparse

import pytest

from ftengine.cli import main
from ftengine.cli.options import at_least


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--kill-trials", "1", "must be >= 2, got 1 (the last trial of each launch"),
        ("--stop-trials", "0", "must be >= 1, got 0"),
        ("--overhead-launches", "0", "must be >= 1, got 0"),
        ("--overhead-rounds", "x", "expected an integer, got 'x'"),
    ],
)
def test_unusable_counts_are_refused_with_the_reason(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "recovery", flag, value])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {message}" in err


def test_at_least_accepts_the_bound_itself() -> None:
    assert at_least(2)("2") == 2
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 2, got -1"):
        at_least(2)("-1")
