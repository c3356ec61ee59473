"""``POST /fault_tolerance/apply`` under bad input, as an attacker or a careless operator
sends it: wrong types for every field, unknown fields, unicode and NUL bytes, deep
nesting, huge bodies (413 before anything is parsed), wrong media types. Each is a 4xx
in vLLM's error object naming what was wrong and what was expected, and leaves every
engine's status, the epoch, the ledger and the served requests exactly as they were."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import anyio
import msgspec
import pytest
from starlette.requests import Request

from ftengine.testbed.control.bodies import (
    MAX_BODY_BYTES,
    BodyTimeout,
    BodyTooLarge,
    read_json_body,
)
from ftengine.testbed.control.errors import MAX_ECHO_CHARS
from tests.unit.control_harness import APPLY, JSON, REQUESTS, Api, error_object

SD = "scale_down"
RANKS = "params.removed_dp_ranks"


@pytest.fixture
def api() -> Iterator[Api]:
    harness = Api()
    harness.cluster.kill(3)  # survivors UNHEALTHY: a good command would be accepted
    with harness.client:
        yield harness


def scale_down(ranks: object) -> dict[str, object]:
    return {"instruction": SD, "params": {"removed_dp_ranks": ranks}}


# (body, needle in the message, param). Every field, every wrong type.
WRONG: list[tuple[object, str, str | None]] = [
    # instruction: missing, falsy, not a string, not a known name (case and bytes matter).
    ({"params": {}}, "'instruction' is required.", "instruction"),
    ({"instruction": None}, "'instruction' is required.", "instruction"),
    ({"instruction": 0}, "'instruction' is required. Found 0", "instruction"),
    ({"instruction": False}, "'instruction' is required. Found False", "instruction"),
    ({"instruction": []}, "'instruction' is required. Found []", "instruction"),
    ({"instruction": 1}, "Invalid instruction: '1'. Expected one of 'retry'", "instruction"),
    ({"instruction": 1.5}, "Invalid instruction: '1.5'.", "instruction"),
    ({"instruction": True}, "Invalid instruction: 'True'.", "instruction"),
    ({"instruction": ["retry"]}, "Invalid instruction: '['retry']'.", "instruction"),
    ({"instruction": {"retry": 1}}, "Invalid instruction: '{'retry': 1}'.", "instruction"),
    ({"instruction": "RETRY"}, "Invalid instruction: 'RETRY'.", "instruction"),
    ({"instruction": " retry"}, "Invalid instruction: ' retry'.", "instruction"),
    ({"instruction": "retry\u0000"}, "Invalid instruction: 'retry\x00'.", "instruction"),
    ({"instruction": "rétry"}, "Invalid instruction: 'rétry'.", "instruction"),
    # params: not an object.
    (
        {"instruction": "retry", "params": None},
        "'params' must be an object. Found NoneType",
        "params",
    ),
    ({"instruction": "retry", "params": "{}"}, "'params' must be an object. Found str", "params"),
    ({"instruction": "retry", "params": 0}, "'params' must be an object. Found int", "params"),
    ({"instruction": "retry", "params": [{}]}, "'params' must be an object. Found list", "params"),
    ({"instruction": "retry", "params": True}, "'params' must be an object. Found bool", "params"),
    # params a retry or scale_down does not take (timeouts included): refused, not ignored.
    ({"instruction": "retry", "params": {"timeout": 5}}, "retry takes no params", "params"),
    (
        {"instruction": "retry", "params": {"removed_dp_ranks": [3]}},
        "retry takes no params",
        "params",
    ),
    (
        {"instruction": SD, "params": {"removed_dp_ranks": [3], "timeout_s": 30}},
        "found unexpected params ['timeout_s']",
        "params",
    ),
    # removed_dp_ranks: missing, not a list, not ints (bools, floats), negative, huge,
    # duplicates, empty, every rank.
    ({"instruction": SD, "params": {}}, "as a list of integer DP ranks", RANKS),
    ({"instruction": SD}, "as a list of integer DP ranks", RANKS),
    (scale_down(None), "found None", RANKS),
    (scale_down(3), "found 3", RANKS),
    (scale_down("3"), "found '3'", RANKS),
    (scale_down({"3": True}), "found {'3': True}", RANKS),
    (scale_down([True]), "found [True]", RANKS),
    (scale_down([3, False]), "found [3, False]", RANKS),
    (scale_down([3.0]), "found [3.0]", RANKS),
    (scale_down([2.5]), "found [2.5]", RANKS),
    (scale_down(["3"]), "found ['3']", RANKS),
    (scale_down([[3]]), "found [[3]]", RANKS),
    (scale_down([None]), "found [None]", RANKS),
    (scale_down([-1]), "[-1] are out of range: this cluster has DP ranks 0..3", RANKS),
    (scale_down([4]), "[4] are out of range", RANKS),
    (scale_down([2**63 - 1]), f"[{2**63 - 1}] are out of range", RANKS),
    (scale_down([10**30]), "are out of range", RANKS),
    (scale_down([3, 3]), "[3, 3] repeats a rank; list each rank once", RANKS),
    (scale_down([]), "is empty: name at least one dead DP rank", RANKS),
    (scale_down([0, 1, 2, 3]), "would remove every one of the 4 DP ranks", RANKS),
    # request_id: not a string, empty, too long, characters a URL path or a log line
    # cannot carry safely (its record lives at /fault_tolerance/requests/<id>).
    ({"instruction": "retry", "request_id": 7}, "found 7", "request_id"),
    ({"instruction": "retry", "request_id": True}, "found True", "request_id"),
    ({"instruction": "retry", "request_id": ["a"]}, "found ['a']", "request_id"),
    ({"instruction": "retry", "request_id": {"a": 1}}, "found {'a': 1}", "request_id"),
    ({"instruction": "retry", "request_id": ""}, "1 to 128 characters", "request_id"),
    ({"instruction": "retry", "request_id": "r" * 129}, "1 to 128 characters", "request_id"),
    ({"instruction": "retry", "request_id": "a/b"}, "found 'a/b'", "request_id"),
    ({"instruction": "retry", "request_id": "a?b#c"}, "A-Z a-z 0-9 . _ ~ : -", "request_id"),
    ({"instruction": "retry", "request_id": "a b"}, "found 'a b'", "request_id"),
    ({"instruction": "retry", "request_id": "x\nINFO forged"}, "found 'x\\nINFO", "request_id"),
    ({"instruction": "retry", "request_id": "r\u0000"}, "found 'r\\x00'", "request_id"),
    ({"instruction": "retry", "request_id": "ré"}, "found 'ré'", "request_id"),
    ({"instruction": "retry", "request_id": "%2e%2e"}, "found '%2e%2e'", "request_id"),
]


def refused(api: Api, content: bytes, headers: dict[str, str], status: int) -> dict[str, Any]:
    """POST ``content``; asserts the status and the error object, and that nothing changed."""
    before = api.state()
    answer = api.client.post(APPLY, content=content, headers=headers)
    assert answer.status_code == status, answer.text
    info = error_object(answer)
    assert api.state() == before, "a refused command changed something"
    return info


@pytest.mark.parametrize(("body", "needle", "param"), WRONG)
def test_wrong_types_for_every_field_are_400_naming_it(
    api: Api, body: object, needle: str, param: str | None
) -> None:
    info = refused(api, msgspec.json.encode(body), JSON, 400)
    assert needle in info["message"], info["message"]
    assert (info["type"], info["param"]) == ("Bad Request", param)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "Invalid JSON format"),
        (b"{oops", "Invalid JSON format"),
        (b'{"instruction": "retry",}', "Invalid JSON format"),
        (b'{"instruction": "retry"} trailing', "Invalid JSON format"),
        (b"\xff\xfe{}", "Invalid JSON format"),
        ('{"instruction": "retry"}'.encode("utf-16"), "Invalid JSON format"),
        (b'{"instruction": "\\ud800"}', "Invalid JSON format"),  # a lone surrogate
        (b'{"instruction": "retry", "params": NaN}', "Invalid JSON format"),
        (b'{"instruction": 1e999}', "Invalid JSON format"),
        (b'{"instruction": 1' + b"0" * 5000 + b"}", "Invalid JSON format"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (
            b'{"instruction": "retry", "params": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001,
            "nested too deeply",
        ),
        (b"null", "Request body must be a JSON object. Found NoneType"),
        (b"[1, 2]", "Request body must be a JSON object. Found list"),
        (b'"retry"', "Request body must be a JSON object. Found str"),
        (b"3", "Request body must be a JSON object. Found int"),
        (b"true", "Request body must be a JSON object. Found bool"),
    ],
)
def test_malformed_json_and_non_object_bodies_are_400(
    api: Api, content: bytes, needle: str
) -> None:
    info = refused(api, content, JSON, 400)
    assert needle in info["message"] and info["type"] == "Bad Request"


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "application/json-patch+json",
        "json",
        "",
    ],
)
def test_a_wrong_content_type_is_vllms_400(api: Api, content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    info = refused(api, msgspec.json.encode(scale_down([3])), headers, 400)
    assert "Only 'application/json' is allowed" in info["message"]
    assert f"found content-type {content_type!r}" in info["message"]


def test_json_media_type_parameters_and_case_are_accepted(api: Api) -> None:
    headers = {"content-type": "Application/JSON; charset=utf-8"}
    answer = api.client.post(APPLY, content=msgspec.json.encode(scale_down([3])), headers=headers)
    assert answer.status_code == 202


def test_a_body_over_the_bound_is_413_before_it_is_parsed(api: Api) -> None:
    # Valid JSON, and a valid command, if it were parsed: the size alone refuses it.
    body = msgspec.json.encode({**scale_down([3]), "pad": "x" * MAX_BODY_BYTES})
    info = refused(api, body, JSON, 413)
    assert info["type"] == "Request Entity Too Large"
    assert f"declared as {len(body)} bytes; the limit is {MAX_BODY_BYTES} bytes" in info["message"]


def test_a_chunked_body_over_the_bound_is_413_too(api: Api) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"instruction": "retry", "pad": "'
        for _ in range(5):
            yield b"x" * (MAX_BODY_BYTES // 4)
        yield b'"}'

    before = api.state()
    answer = api.client.post(APPLY, content=chunks(), headers=JSON)
    assert answer.status_code == 413, answer.text
    assert "content-length" not in answer.request.headers, "the body must go chunked"
    assert f"over {MAX_BODY_BYTES} bytes so far" in error_object(answer)["message"]
    assert api.state() == before


def test_a_body_at_the_bound_is_judged_as_usual(api: Api) -> None:
    prefix = b'{"instruction": "scale_down", "params": {"removed_dp_ranks": [3]}, "pad": "'
    body = prefix + b"x" * (MAX_BODY_BYTES - len(prefix) - 2) + b'"}'
    assert len(body) == MAX_BODY_BYTES
    assert api.client.post(APPLY, content=body, headers=JSON).status_code == 202


def test_unknown_top_level_fields_are_ignored_as_vllm_ignores_them(api: Api) -> None:
    # vLLM's _validate_payload reads only instruction and params; anything else, of any
    # type, is ignored. Unknown *params* are refused (above): they would change the command.
    body = {**scale_down([3]), "request_id": "u", "timeout": "soon", "force": True, "é\u0000": [{}]}
    answer = api.client.post(APPLY, json=body)
    assert answer.status_code == 202
    api.jobs.run_all()
    assert api.cluster.calls == [("scale_down", {"removed_dp_ranks": [3]}, "u")]


def test_an_echoed_value_is_clipped_so_the_answer_does_not_grow_with_the_body(api: Api) -> None:
    for body in (
        {"instruction": "x" * 1_000_000},
        scale_down(list(range(100, 200_100))),
        {"instruction": "retry", "request_id": "/" * 1_000_000},
        {"instruction": "retry", "params": {f"k{i}": i for i in range(100_000)}},
    ):
        answer = api.client.post(APPLY, json=body)
        assert answer.status_code == 400
        assert len(error_object(answer)["message"]) < MAX_ECHO_CHARS + 300, answer.text[:400]
        assert "more chars]" in answer.text


def test_every_accepted_request_id_has_a_reachable_record(api: Api) -> None:
    request_id = "Az09._~:-" + "x" * 119
    assert (
        api.client.post(APPLY, json={**scale_down([3]), "request_id": request_id}).status_code
        == 202
    )
    accepted = api.client.get(f"{REQUESTS}/{request_id}")
    assert accepted.status_code == 200 and accepted.json()["request_id"] == request_id


async def _asgi_post(api: Api, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """POST straight into the ASGI app with a receive that fails if the body is ever read."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 1),
             "server": ("ftengine.test", 80)}  # fmt: skip
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        raise AssertionError("the body was read although its declared size is over the bound")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    await api.app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.mark.parametrize("path", [APPLY, "/v1/completions"])
@pytest.mark.parametrize(
    ("length", "status", "needle"),
    [
        (str(MAX_BODY_BYTES + 1), 413, f"declared as {MAX_BODY_BYTES + 1} bytes"),
        ("1" + "0" * 30, 413, "the limit is"),
        ("-5", 400, "Content-Length must be a byte count, found '-5'"),
        ("lots", 400, "Content-Length must be a byte count, found 'lots'"),
        ("\u00b2", 400, "Content-Length must be a byte count"),  # a unicode digit
    ],
)
def test_a_declared_length_is_judged_before_one_byte_is_read(
    api: Api, path: str, length: str, status: int, needle: str
) -> None:
    before = api.state()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", length.encode("latin-1")),
    ]
    code, body = anyio.run(_asgi_post, api, path, headers)
    assert code == status and needle in msgspec.json.decode(body)["error"]["message"]
    assert api.state() == before


def test_an_unknown_record_id_is_404_with_the_id_clipped(api: Api) -> None:
    answer = api.client.get(f"{REQUESTS}/{'z' * 20_000}")
    assert answer.status_code == 404
    message = error_object(answer)["message"]
    assert message.startswith("no command with request_id 'zzz") and "more chars]" in message
    assert len(message) < MAX_ECHO_CHARS + 100


def _request(chunks: list[bytes], stall: bool) -> Request:
    """A JSON POST whose body arrives as ``chunks`` and then, with ``stall``, never ends."""
    scope = {"type": "http", "method": "POST", "path": APPLY, "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}  # fmt: skip
    pending = list(chunks)

    async def receive() -> MutableMapping[str, Any]:
        if pending:
            return {"type": "http.request", "body": pending.pop(0), "more_body": True}
        if stall:
            await anyio.sleep_forever()
        return {"type": "http.request", "body": b"", "more_body": False}

    return Request(scope, receive)


def test_a_stalled_body_is_a_408_not_a_hung_request() -> None:
    async def read() -> None:
        with pytest.raises(BodyTimeout, match=r"did not arrive within 0\.05 s") as info:
            await read_json_body(_request([b'{"instruction": '], stall=True), timeout_s=0.05)
        assert info.value.status == 408

    anyio.run(read)


def test_a_body_in_many_chunks_is_read_whole_up_to_the_bound() -> None:
    async def read() -> None:
        body = await read_json_body(_request([b"[1,", b" 2", b"]"], stall=False), limit=7)
        assert body == b"[1, 2]"
        with pytest.raises(BodyTooLarge, match="over 5 bytes so far"):
            await read_json_body(_request([b"[1,", b" 2", b"]"], stall=False), limit=5)

    anyio.run(read)
