"""The vLLM-Ascend-style configuration surface of the NPU backend (``additional_config``).

``--additional-config '{"ft_communication_abort_timeout": 30, "ftengine": {"policy": "auto"}}'``:
the top-level key is the one vLLM-Ascend defines; ftengine's own options live in the
``ftengine`` sub-dict. Other top-level keys belong to vLLM-Ascend and are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

import attrs

from ftengine.backends.npu_timeouts import ABORT_TIMEOUT_KEY, validate_abort_timeout
from ftengine.errors import ConfigError
from ftengine.policies.registry import check_name
from ftengine.reinference import DEFAULT_MAX_REINFERENCE

FTENGINE_KEY = "ftengine"
PLACEMENTS = ("default", "failure-aware")
"""``ftengine.placement`` values. On vLLM's CPU platform "failure-aware" loads standby expert
copies at start-up (``ftengine.integrations.vllm.worker.experts_standby``); on an NPU the slot
layout is vLLM-Ascend's expert map (``ftengine plan --placement failure-aware`` writes one)."""


def _positive_seconds(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{key} must be a positive number of seconds, found {value!r}")
    return float(value)


def _optional_seconds(value: object, key: str) -> float | None:
    return None if value is None else _positive_seconds(value, key)


def _policy(value: object, key: str) -> str:
    try:
        return check_name(value)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


def _flag(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, found {value!r}")
    return value


def _count(value: object, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key} must be an integer >= 0, found {value!r}")
    return value


def _placement(value: object, key: str) -> str:
    if value not in PLACEMENTS:
        raise ConfigError(f"{key} must be one of {', '.join(PLACEMENTS)}, found {value!r}")
    return str(value)


def _urls(value: object, key: str) -> tuple[str, ...]:
    """Base URLs of OpenAI servers (``http://host:port``, no path), trailing ``/`` dropped."""
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(
            f'{key} must be a list of URLs such as ["http://10.0.0.2:8000"], found {value!r}'
        )
    urls = tuple(v.rstrip("/") for v in value)
    for url in urls:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            raise ConfigError(f"{key}: expected http(s)://host:port, found {url!r}")
        if parts.path or parts.query or parts.fragment:
            raise ConfigError(f"{key}: expected a server's base URL without a path, found {url!r}")
    if len(set(urls)) != len(urls):
        raise ConfigError(f"{key}: each URL at most once, found {list(urls)}")
    return urls


def ftengine_options(additional_config: Mapping[str, object]) -> Mapping[str, object]:
    """The ``ftengine`` sub-dict of ``additional_config`` ({} if absent); ``ConfigError`` if it
    is not a JSON object."""
    sub = additional_config.get(FTENGINE_KEY, {})
    if not isinstance(sub, Mapping):
        raise ConfigError(
            f'{FTENGINE_KEY} must be a JSON object such as {{"policy": "auto"}}, found {sub!r}'
        )
    return sub


@attrs.frozen
class NpuFtConfig:
    """Fault-tolerance options of one NPU worker.

    ``communication_abort_timeout_s``: T (0 = off), see ``npu_timeouts``.
    ``policy``: a name in ``ftengine.policies.registry`` ("orchestrator": wait for a command,
    vLLM's behaviour; "auto").
    ``scale_down``: whether scale-down must be possible (its preconditions are then
    checked at start-up). ``recovery_timeout_s``: how long to wait for a command before
    DEAD. ``cpu_distributed_timeout_s``: timeout of the gloo groups ftengine owns
    (None = torch's default). ``reinference`` (default on): a fault holds the engine core's
    requests and resumes them after recovery instead of aborting them, and a DEAD engine
    core hands them to a survivor (vLLM's CPU path; see
    ``ftengine.integrations.vllm.engine_core.reinference`` and ``.handoff``);
    ``max_reinference``: re-runs of one request after faults before it is aborted.
    ``placement``: one of :data:`PLACEMENTS`. ``handoff_urls``: the survivors' OpenAI
    servers a DEAD engine core hands its held requests to, instead of those it finds on
    vLLM's DP store (needs ``reinference``).
    """

    communication_abort_timeout_s: int = 0
    policy: str = "orchestrator"
    scale_down: bool = True
    recovery_timeout_s: float = 120.0
    cpu_distributed_timeout_s: float | None = None
    reinference: bool = True
    max_reinference: int = DEFAULT_MAX_REINFERENCE
    placement: str = "default"
    handoff_urls: tuple[str, ...] = ()

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, object] | None) -> NpuFtConfig:
        """Read the config from vLLM's ``additional_config`` dict; bad values → ``ConfigError``."""
        config = dict(additional_config or {})
        timeout = validate_abort_timeout(config.get(ABORT_TIMEOUT_KEY, 0), key=ABORT_TIMEOUT_KEY)
        return cls.from_options(ftengine_options(config), communication_abort_timeout_s=timeout)

    @classmethod
    def from_options(
        cls, options: Mapping[str, object], *, communication_abort_timeout_s: int = 0
    ) -> NpuFtConfig:
        """Read the ``ftengine`` sub-dict; an unknown key is an error (it is usually a typo)."""
        parsers = {
            "policy": ("policy", _policy),
            "scale_down": ("scale_down", _flag),
            "recovery_timeout_sec": ("recovery_timeout_s", _positive_seconds),
            "cpu_distributed_timeout_sec": ("cpu_distributed_timeout_s", _optional_seconds),
            "reinference": ("reinference", _flag),
            "max_reinference": ("max_reinference", _count),
            "placement": ("placement", _placement),
            "handoff_urls": ("handoff_urls", _urls),
        }
        values: dict[str, object] = {}
        for key, value in options.items():
            if key not in parsers:
                raise ConfigError(
                    f"unknown option {FTENGINE_KEY}.{key}; expected one of "
                    f"{', '.join(sorted(parsers))}"
                )
            field, parse = parsers[key]
            values[field] = parse(value, f"{FTENGINE_KEY}.{key}")
        reinference = values.get("reinference", attrs.fields(cls).reinference.default)
        if values.get("handoff_urls") and not reinference:
            raise ConfigError(
                f"{FTENGINE_KEY}.handoff_urls needs {FTENGINE_KEY}.reinference: true (only held "
                "requests are handed off), found reinference: false"
            )
        return cls(communication_abort_timeout_s=communication_abort_timeout_s, **values)  # type: ignore[arg-type]
