"""Bearer-key check for mutating endpoints, and the bind-address rule ``serve`` enforces."""

from __future__ import annotations

import hmac
import ipaddress

from ftengine.errors import ConfigError, FTEngineError

API_KEY_ENV = "FTENGINE_API_KEY"


class Unauthorized(FTEngineError, PermissionError):
    """A mutating request came without the right ``Authorization: Bearer <key>`` (HTTP 401)."""


class ApiKeyGuard:
    """Checks ``Authorization`` headers against ``key``; with no key every request passes."""

    def __init__(self, key: str | None) -> None:
        check_key(key)
        self._key = key

    @property
    def enabled(self) -> bool:
        """True when a key is set and mutating endpoints require it."""
        return self._key is not None

    def check(self, authorization: str | None) -> None:
        """Raise ``Unauthorized`` unless ``authorization`` is ``Bearer <key>`` (no key: pass)."""
        if self._key is None:
            return
        if not authorization:
            raise Unauthorized("missing Authorization header: send 'Authorization: Bearer <key>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("Authorization must be 'Bearer <key>'")
        # Constant-time comparison: the key must not leak through response timing.
        if not hmac.compare_digest(token.strip().encode(), self._key.encode()):
            raise Unauthorized("wrong API key")


def check_key(key: str | None) -> None:
    """Refuse a key no client could send: empty, or with whitespace at either end (HTTP
    strips it from the header, so the comparison could never succeed)."""
    if key is None:
        return
    if not key.strip():
        raise ConfigError("the API key is empty; pass a non-empty --api-key or leave it unset")
    if key != key.strip():
        raise ConfigError(
            "the API key starts or ends with whitespace, which no Authorization header can "
            "carry; pass the key without it"
        )


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse a key no client could send, and serving the control API beyond loopback
    without an API key."""
    check_key(api_key)
    if api_key is None and not is_loopback(host):
        raise ConfigError(
            f"refusing to bind {host!r} without an API key: the control API can kill and "
            f"shrink the cluster. Set --api-key or {API_KEY_ENV}, or bind 127.0.0.1"
        )
