"""Bearer-key checks and the loopback-only rule for serving without a key."""

from __future__ import annotations

import pytest

from ftengine.control.auth import ApiKeyGuard, Unauthorized, check_bind, is_loopback
from ftengine.errors import ConfigError


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_non_loopback_bind_needs_a_key() -> None:
    with pytest.raises(ConfigError, match=r"refusing to bind '0\.0\.0\.0' without an API key"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "key")
    check_bind("127.0.0.1", None)


def test_guard_without_a_key_lets_everything_through() -> None:
    guard = ApiKeyGuard(None)
    assert not guard.enabled
    guard.check(None)
    guard.check("Bearer anything")


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        (None, "missing Authorization"),
        ("", "missing Authorization"),
        ("Basic a2V5", "must be 'Bearer <key>'"),
        ("Bearer", "must be 'Bearer <key>'"),
        ("Bearer nope", "wrong API key"),
        ("Bearer key2", "wrong API key"),
    ],
)
def test_guard_with_a_key_rejects(header: str | None, needle: str) -> None:
    with pytest.raises(Unauthorized, match=needle):
        ApiKeyGuard("key").check(header)


def test_guard_accepts_the_key_case_insensitive_scheme() -> None:
    guard = ApiKeyGuard("key")
    assert guard.enabled
    guard.check("Bearer key")
    guard.check("bearer key")


def test_an_empty_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="API key is empty"):
        ApiKeyGuard("  ")
