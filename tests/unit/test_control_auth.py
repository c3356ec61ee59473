"""Bearer-key checks and the loopback-only rule for serving without a key."""

from __future__ import annotations

import hmac

import pytest

from ftengine.errors import ConfigError
from ftengine.testbed.control import auth
from ftengine.testbed.control.auth import ApiKeyGuard, Unauthorized, check_bind, is_loopback


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


@pytest.mark.parametrize(
    ("key", "needle"),
    [("", "API key is empty"), (" key", "starts or ends with whitespace"), ("key\t", "whitespace")],
)
def test_a_key_no_client_could_send_is_refused_wherever_it_enters(key: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ApiKeyGuard(key)
    with pytest.raises(ConfigError, match=needle):
        check_bind("0.0.0.0", key)  # an empty key must not pass for "a key is set"
    with pytest.raises(ConfigError, match=needle):
        check_bind("127.0.0.1", key)


class Spy:
    """Records every ``compare_digest`` call and answers ``verdict`` (None: the real one)."""

    def __init__(self, verdict: bool | None = None) -> None:
        self.calls: list[tuple[bytes, bytes]] = []
        self.verdict = verdict

    def compare_digest(self, a: bytes, b: bytes) -> bool:
        self.calls.append((a, b))
        return hmac.compare_digest(a, b) if self.verdict is None else self.verdict


def test_the_key_is_compared_in_constant_time_by_hmac_compare_digest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = Spy()
    monkeypatch.setattr(auth, "hmac", spy)  # only auth's name: hmac itself stays whole
    guard = ApiKeyGuard("s3cret")
    guard.check("Bearer s3cret")
    for wrong in ("Bearer s3creT", "Bearer s", "Bearer s3cret-and-more"):
        with pytest.raises(Unauthorized, match="wrong API key"):
            guard.check(wrong)
    assert spy.calls == [
        (b"s3cret", b"s3cret"),
        (b"s3creT", b"s3cret"),
        (b"s", b"s3cret"),
        (b"s3cret-and-more", b"s3cret"),
    ], "every comparison, of any length, goes through compare_digest"
    # Its answer is the verdict: nothing else (no ==) decides.
    monkeypatch.setattr(auth, "hmac", Spy(verdict=True))
    guard.check("Bearer anything")
    monkeypatch.setattr(auth, "hmac", Spy(verdict=False))
    with pytest.raises(Unauthorized):
        guard.check("Bearer s3cret")


def test_a_non_ascii_token_is_compared_not_crashed_on() -> None:
    guard = ApiKeyGuard("kéy")
    guard.check("Bearer kéy")
    for token in ("Bearer k\u00e9y\u0000", "Bearer \u00ff\u00fe", "Bearer 🙂"):
        with pytest.raises(Unauthorized, match="wrong API key"):
            guard.check(token)
