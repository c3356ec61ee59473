"""The one classifier of collective errors: types first, then one table of gloo message
families, read the same way by the sentinel and by the CPU backend's gloo translation."""

from __future__ import annotations

import pytest

from ftengine.collective_errors import (
    MESSAGE_FAMILIES,
    classify_exception,
    error_text,
    message_family,
)
from ftengine.errors import (
    BackendError,
    CollectiveTimeout,
    DeviceError,
    PeerDead,
    WeightLoadError,
)
from ftengine.faults import FaultKind
from ftengine.testbed.cpu.comm import translate_gloo_error

_PAIR = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534]"
_BUFFER = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81]"

# (message, the family that claims it or None, the fault kind it stands for)
MESSAGES = [
    (f"{_PAIR} Connection closed by peer [127.0.0.1]:25407", "connection closed by peer", "dead"),
    ("peer 3 is gone", "connection closed by peer", "dead"),
    (
        f"{_PAIR} Read error [127.0.0.1]:52946: Connection reset by peer",
        "connection reset / refused",
        "dead",
    ),
    (
        f"{_PAIR} connect [127.0.0.1]:29500: Connection refused",
        "connection reset / refused",
        "dead",
    ),
    (f"{_PAIR} Write error [127.0.0.1]:25407: Broken pipe", "broken pipe / end of file", "dead"),
    ("recv: unexpected EOF from a peer", "broken pipe / end of file", "dead"),
    (f"{_BUFFER} Timed out waiting 2000ms for recv operation to complete", "timeout", "hung"),
    ("Application timeout caused pair closure", "timeout", "hung"),
    (f"{_PAIR} Connect timeout [127.0.0.1]:29500", "timeout", "hung"),
    ("HCCL: deadline exceeded", "timeout", "hung"),
    ("something else broke", None, "none"),
    # Where the two classifiers used to disagree (see the test below):
    ("Timed out waiting 2000ms: Connection closed by peer", "connection closed by peer", "dead"),
    ("all_to_all failed\nframe #3: gloo::UnboundBuffer::waitRecv timeout", None, "none"),
    ("no guarantee whereof", None, "none"),
]
KIND = {"dead": FaultKind.DEAD_PEER, "hung": FaultKind.HUNG_PEER, "none": FaultKind.TRANSIENT}
TRANSLATED = {"dead": PeerDead, "hung": CollectiveTimeout, "none": BackendError}


@pytest.mark.parametrize(("message", "family", "meaning"), MESSAGES)
def test_each_message_family_means_the_same_fault_on_both_paths(
    message: str, family: str | None, meaning: str
) -> None:
    """Before this table the sentinel (``classify_exception``) and the CPU backend
    (``translate_gloo_error``) each had their own regexes, and they disagreed:

    - a message naming both a timeout and a closed connection was HUNG_PEER to the
      sentinel (timeouts tested first) but PeerDead to the backend (peer-gone first);
      now the closed connection wins on both paths;
    - "deadline exceeded", "EOF" and "peer ... gone" meant a timeout / a dead peer to the
      sentinel but an untyped BackendError (so TRANSIENT) to the backend;
    - the sentinel read the whole message, C++ backtrace lines included, the backend only
      the first line; now both read the first line;
    - the sentinel's "EOF" matched inside words ("whereof"); now only the word.
    """
    text = error_text(RuntimeError(message))
    found = message_family(text)
    assert (None if found is None else found.name) == family
    assert classify_exception(RuntimeError(message)) is KIND[meaning]
    translated = translate_gloo_error(RuntimeError(message), "epoch-1 all_to_all")
    assert type(translated) is TRANSLATED[meaning]
    assert text in str(translated)
    # The backend's typed error reaches the sentinel as the same fault kind.
    assert classify_exception(translated) is KIND[meaning]


def test_every_family_has_a_message_above() -> None:
    assert {family for _, family, _ in MESSAGES} - {None} == {f.name for f in MESSAGE_FAMILIES}


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (CollectiveTimeout("op timed out"), FaultKind.HUNG_PEER),
        (TimeoutError("slow"), FaultKind.HUNG_PEER),
        (PeerDead("closed"), FaultKind.DEAD_PEER),
        (ConnectionResetError("reset"), FaultKind.DEAD_PEER),
        (DeviceError("stream poisoned"), FaultKind.DEVICE_ERROR),
        (RuntimeError("[pair.cc:537] Read error: Connection reset by peer"), FaultKind.DEAD_PEER),
        (RuntimeError("Timed out waiting 1000ms for recv operation"), FaultKind.HUNG_PEER),
        (RuntimeError("something else broke"), FaultKind.TRANSIENT),
        (ValueError("timed out"), FaultKind.TRANSIENT),  # only plain RuntimeError text is read
        (WeightLoadError("bad tensor"), FaultKind.TRANSIENT),
        (BackendError("refused"), FaultKind.TRANSIENT),
        (BackendError("Connection refused"), FaultKind.TRANSIENT),  # its type has spoken
    ],
)
def test_classify_exception_by_type_first(exc: BaseException, kind: FaultKind) -> None:
    assert classify_exception(exc) is kind


def test_error_text_is_the_first_line_or_the_type_name() -> None:
    assert error_text(RuntimeError("  first\nsecond")) == "first"
    assert error_text(RuntimeError("")) == "RuntimeError"
