"""``ftengine serve`` refuses a bad policy before it binds a port or writes a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftengine.cli import main


def test_a_policy_that_does_not_import_is_refused_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = tmp_path / "never-written"
    code = main(["serve", "--policy", "nowhere:make", "--checkpoint", str(checkpoint)])
    assert code == 2
    err = capsys.readouterr().err
    assert "policy 'nowhere:make': cannot import nowhere" in err
    assert "Traceback" not in err
    assert not checkpoint.exists()


def test_an_unknown_policy_name_is_refused_listing_the_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--policy", "sometimes"]) == 2
    assert "expected one of 'auto', 'orchestrator'" in capsys.readouterr().err
