"""Random JSON (and random bytes) thrown at every route, in process: never a 5xx, never a
hung request, always the route's error object for a 4xx, and nothing changed by any
rejected request (status, epoch, ledger, commands run, requests served)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx
import msgspec
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from ftengine.testbed.control.served_model import ServedModel, load_tokenizer
from ftengine.testbed.model_limits import ModelLimits
from tests.strategies import (
    APPLY_FIELDS,
    COMPLETION_FIELDS,
    json_objects,
    json_values,
    mutations,
)
from tests.unit.control_harness import APPLY, COMPLETIONS, MODELS, REQUESTS, STATUS, Api
from tests.unit.control_harness import error_object as check_error_object
from tests.unit.control_standin import POISON
from tests.unit.test_control_completions import word_tokenizer

ANSWER_TIMEOUT_S = 10.0
FUZZ_VOCAB = POISON  # every id the stand-in would fail on is out of vocabulary: a 400

media_types = st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain"])
# Values that are right for some field, so that random objects also get past the first
# checks (and sometimes are served) rather than all failing at the same place.
APPLY_NEAR: tuple[object, ...] = (
    "retry",
    "scale_down",
    {},
    {"removed_dp_ranks": [3]},
    {"removed_dp_ranks": [1]},
    "a",
)
COMPLETION_NEAR: tuple[object, ...] = (
    [1, 2],
    [[3], [4, 5]],
    "w1 w2",
    ["w3"],
    2,
    0,
    True,
    False,
    "standin",
    [4],
)
GOOD_APPLY: dict[str, object] = {"instruction": "scale_down", "params": {"removed_dp_ranks": [3]}}
GOOD_COMPLETION: dict[str, object] = {"prompt": [1, 2], "max_tokens": 2}
apply_bodies = st.one_of(
    json_objects(APPLY_FIELDS, APPLY_NEAR),
    mutations(GOOD_APPLY, APPLY_FIELDS, APPLY_NEAR),
    json_values,
)
completion_bodies = st.one_of(
    json_objects(COMPLETION_FIELDS, COMPLETION_NEAR),
    mutations(GOOD_COMPLETION, COMPLETION_FIELDS, COMPLETION_NEAR),
    json_values,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedModel]:
    """A model with a tokenizer (text prompts get tokenised) and a small context."""
    tokenizer, _ = load_tokenizer(word_tokenizer(Path(tmp_path_factory.mktemp("fuzz"))))
    yield ServedModel("standin", "/standin", ModelLimits(FUZZ_VOCAB, 64), tokenizer)


async def _send(
    api: Api, method: str, path: str, content: bytes | None, media: str
) -> httpx.Response:
    async with api.async_client() as client:
        request = client.request(method, path, content=content, headers={"content-type": media})
        return await asyncio.wait_for(request, ANSWER_TIMEOUT_S)


def judged(
    api: Api,
    method: str,
    path: str,
    content: bytes | None = None,
    media: str = "application/json",
    recovering: bool = False,
) -> httpx.Response:
    """Send one request; asserts it answered in time, below 500, and changed nothing if
    refused. While the cluster is ``recovering``, a 503 saying so is the one 5xx allowed:
    readiness, or a well-formed completion that cannot be served until recovery ends."""
    before = api.state()
    answer = asyncio.run(_send(api, method, path, content, media))
    if recovering and answer.status_code == 503:
        assert path == "/health" or answer.headers["retry-after"] == "1", answer.text
        assert api.state() == before
        return answer
    assert answer.status_code < 500, (path, content, answer.text)
    if answer.status_code >= 400:
        check_error_object(answer)
        assert api.state() == before, (path, content, answer.text)
    return answer


def fresh(model: ServedModel, faulted: bool) -> Api:
    api = Api(model=model)
    if faulted:
        api.cluster.kill(3)  # survivors UNHEALTHY: commands are judged, completions are 503
    return api


@given(body=apply_bodies, media=media_types, faulted=st.booleans())
def test_random_json_at_apply(model: ServedModel, body: object, media: str, faulted: bool) -> None:
    api = fresh(model, faulted)
    answer = judged(api, "POST", APPLY, msgspec.json.encode(body), media)
    event(f"apply answered {answer.status_code}")
    if answer.status_code in (200, 202):
        assert len(api.plane.ledger.entries()) == 1, "an accepted command is recorded"


@given(body=completion_bodies, media=media_types, faulted=st.booleans())
def test_random_json_at_completions(
    model: ServedModel, body: object, media: str, faulted: bool
) -> None:
    api = fresh(model, faulted)
    answer = judged(api, "POST", COMPLETIONS, msgspec.json.encode(body), media, faulted)
    event(f"completions answered {answer.status_code}")
    if answer.status_code == 200:
        assert api.service.requests, "a served completion went through the serving loop"


@given(content=st.binary(max_size=64), path=st.sampled_from([APPLY, COMPLETIONS]))
def test_random_bytes_at_the_posts(model: ServedModel, content: bytes, path: str) -> None:
    judged(fresh(model, True), "POST", path, content, recovering=True)


@given(
    request_id=st.text(max_size=40),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    faulted=st.booleans(),
)
def test_random_ids_and_methods_at_the_reads(
    model: ServedModel, request_id: str, method: str, faulted: bool
) -> None:
    api = fresh(model, faulted)
    for path in (f"{REQUESTS}/{quote(request_id, safe='')}", STATUS, MODELS, "/health", "/metrics"):
        answer = judged(api, method, path, b"{}", recovering=faulted)
        assert answer.status_code != 200 or method == "GET"
