"""``ftengine``'s command line: the product's own commands, plus those of every package the
``ftengine.commands`` entry-point group names (the test bed's when installed), plus, in a
source checkout without entry points, the test bed's found by name."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from pathlib import Path

import pytest

from ftengine import cli

PRODUCT_COMMANDS = {"fsm", "plan"}
TESTBED_COMMANDS = {"make-checkpoint", "chaos", "chaos-vllm", "demo", "serve", "vllm"}


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    subparsers = next(
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    )
    return set(subparsers.choices) - {"bench"}


REAL_ENTRY_POINTS = importlib.metadata.entry_points


def _group(*entries: importlib.metadata.EntryPoint) -> object:
    """``importlib.metadata.entry_points`` with the command group holding ``entries`` only
    (other groups, e.g. torch's, as installed)."""

    def entry_points(*, group: str) -> object:
        return list(entries) if group == cli.COMMANDS_GROUP else REAL_ENTRY_POINTS(group=group)

    return entry_points


def _entry(name: str, package: str) -> importlib.metadata.EntryPoint:
    return importlib.metadata.EntryPoint(name=name, value=package, group=cli.COMMANDS_GROUP)


@pytest.fixture
def hello_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A package of one command module, ``hello`` (exit status 7), importable by name."""
    (tmp_path / "hello_commands").mkdir()
    (tmp_path / "hello_commands" / "__init__.py").write_text("")
    (tmp_path / "hello_commands" / "hello.py").write_text(
        '"""Say hello."""\nCOMMAND = "hello"\n'
        "def register(parser):\n    parser.set_defaults(func=lambda args: 7)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "hello_commands"


def test_the_group_names_the_packages_whose_commands_join(
    monkeypatch: pytest.MonkeyPatch, hello_package: str
) -> None:
    testbed, hello = _entry("testbed", cli.TESTBED_COMMANDS), _entry("hello", hello_package)
    monkeypatch.setattr(importlib.metadata, "entry_points", _group(testbed, hello))
    assert _commands(cli.build_parser()) == PRODUCT_COMMANDS | TESTBED_COMMANDS | {"hello"}
    assert cli.main(["hello"]) == 7


def test_a_group_that_names_packages_is_all_that_joins(
    monkeypatch: pytest.MonkeyPatch, hello_package: str
) -> None:
    """The test bed is found by name only where the group is empty (a source checkout)."""
    monkeypatch.setattr(importlib.metadata, "entry_points", _group(_entry("h", hello_package)))
    assert _commands(cli.build_parser()) == PRODUCT_COMMANDS | {"hello"}


def test_a_checkout_without_entry_points_finds_the_test_bed_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", _group())
    parser = cli.build_parser()
    assert _commands(parser) == PRODUCT_COMMANDS | TESTBED_COMMANDS
    assert parser.parse_args(["bench", "placement"]).bench == "placement"


def test_without_the_test_bed_the_products_commands_still_work(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", _group())
    monkeypatch.setitem(sys.modules, cli.TESTBED_COMMANDS, None)  # as if not shipped
    assert _commands(cli.build_parser()) == PRODUCT_COMMANDS
    assert cli.main(["fsm"]) == 0
    assert capsys.readouterr().out.startswith("trigger")


def test_a_test_bed_that_fails_inside_is_not_taken_for_an_absent_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", _group())
    monkeypatch.setitem(sys.modules, "ftengine.testbed.cli.serve", None)
    with pytest.raises(ModuleNotFoundError):
        cli.build_parser()
