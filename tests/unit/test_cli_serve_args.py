"""``ftengine serve`` refuses a bad policy, a public bind without a key and a key no client
could send before it binds a port, writes a checkpoint or starts a process (exit 2)."""

from __future__ import annotations

import socket
from pathlib import Path

import psutil
import pytest

from ftengine.cli import main
from ftengine.testbed.control.auth import API_KEY_ENV


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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize(
    ("host", "env_key", "flags", "needle"),
    [
        ("0.0.0.0", None, [], "refusing to bind '0.0.0.0' without an API key"),
        ("::", None, [], "refusing to bind '::' without an API key"),
        ("", None, [], "refusing to bind '' without an API key"),  # every interface
        ("10.1.2.3", None, [], "refusing to bind '10.1.2.3'"),
        ("example.com", None, [], "refusing to bind 'example.com'"),
        ("0.0.0.0", "", [], "refusing to bind '0.0.0.0' without an API key"),
        ("0.0.0.0", None, ["--api-key", ""], "the API key is empty"),
        ("0.0.0.0", None, ["--api-key", "   "], "the API key is empty"),
        ("127.0.0.1", None, ["--api-key", ""], "the API key is empty"),
        ("0.0.0.0", " k3y", [], "the API key starts or ends with whitespace"),
    ],
)
def test_serve_refuses_a_public_bind_without_a_key_and_starts_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    host: str,
    env_key: str | None,
    flags: list[str],
    needle: str,
) -> None:
    if env_key is None:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(API_KEY_ENV, env_key)
    checkpoint = tmp_path / "never-written"
    port = _free_port()
    before = _children()
    argv = ["serve", "--host", host, "--port", str(port), "--checkpoint", str(checkpoint), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"ftengine serve: {needle}" in err and "Traceback" not in err, err
    assert not checkpoint.exists(), "no checkpoint written"
    assert _children() == before, "no process started"
    with socket.socket() as again:  # the port was never bound (or was released)
        again.bind(("127.0.0.1", port))
