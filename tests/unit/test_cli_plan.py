"""``ftengine plan``: the JSON report and clear failures for invalid shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftengine.cli import main

SMALL = ["plan", "--layers", "2", "--experts", "16", "--ep", "4", "--redundant", "16"]
FIELDS = {
    "reloads",
    "reload_lower_bound",
    "balancedness",
    "balancedness_fresh_rebalance",
    "fresh_rebalance_reloads",
    "plan_ms",
    "apply_ms",
    "elastic_info_us",
    "elastic_info_in_place",
    "single_rank_zero_reload_fraction",
    "single_rank_zero_reload_bound",
}


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main([*SMALL, *args, "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert isinstance(report, dict)
    return report


def test_json_report_has_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    report = _run(capsys, "--dead", "1,3")
    assert report.keys() >= FIELDS
    assert report["reloads"] == report["reload_lower_bound"]
    assert report["dead"] == [1, 3]
    assert report["elastic_info_in_place"] is True and report["maps_in_place"] is True
    assert report["single_rank_zero_reload_bound"] == 1.0  # 32 slots >= 2 x 16 experts


def test_extra_reloads_and_a_zipf_load(capsys: pytest.CaptureFixture[str]) -> None:
    report = _run(capsys, "--dead", "2", "--placement", "balanced", "--load", "zipf")
    lower = report["reload_lower_bound"]
    assert isinstance(lower, int)
    budget = _run(
        capsys, "--dead", "2", "--placement", "balanced", "--load", "zipf", "--extra-reloads", "3"
    )
    assert budget["reload_lower_bound"] == lower
    reloads = budget["reloads"]
    assert isinstance(reloads, int) and lower <= reloads <= lower + 3


def test_load_from_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "load.json"
    path.write_text(json.dumps([[float(e + 1) for e in range(16)]] * 2))
    report = _run(capsys, "--dead", "0", "--load", str(path))
    assert report["load"] == str(path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--redundant", "17", "--dead", "1"], "33 is not divisible by ep_size 4"),
        (["--dead", "4"], r"dead EP ranks [4] are out of range [0, 4)"),
        (["--dead", "0,1,2,3"], "all 4 EP ranks are dead"),
        (["--redundant", "0", "--dead", "1"], "insufficient redundancy"),
        (["--dead", "1", "--load", "missing.json"], "expected 'uniform', 'zipf' or an existing"),
    ],
)
def test_invalid_shapes_exit_non_zero_with_a_reason(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main([*SMALL, *args, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


def test_unparsable_dead_ranks_are_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main([*SMALL, "--dead", "three"])
    assert caught.value.code == 2
    assert "comma-separated EP ranks" in capsys.readouterr().err
