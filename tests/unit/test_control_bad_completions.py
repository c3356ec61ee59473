"""``/v1/completions`` under bad input: wrong types for every field, huge prompts and
``max_tokens`` past the model's limits, unicode and NUL bytes, huge bodies (413), wrong
media types. Each is a 4xx in the OpenAI error object (vLLM's) naming the field and what
was expected, and nothing reaches the serving loop; unknown fields are ignored, as vLLM's
OpenAI server (and OpenAI's) ignore them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from ftengine.testbed.control.bodies import MAX_BODY_BYTES
from ftengine.testbed.control.completions import MAX_CHARS_PER_TOKEN
from ftengine.testbed.control.errors import MAX_ECHO_CHARS
from ftengine.testbed.control.served_model import ServedModel, load_tokenizer
from ftengine.testbed.model_limits import ModelLimits
from tests.unit.control_harness import COMPLETIONS, JSON, Api, error_object
from tests.unit.control_standin import VOCAB
from tests.unit.test_control_completions import word_tokenizer

MAX_LEN = 64  # the stand-in model's context


@pytest.fixture
def api() -> Iterator[Api]:
    harness = Api()
    with harness.client:
        yield harness


def one(**fields: object) -> dict[str, object]:
    return {"prompt": [1, 2], "max_tokens": 2, **fields}


# (body, needle in the message, param): every field the endpoint reads, each wrong type.
WRONG: list[tuple[object, str, str | None]] = [
    (one(prompt=7), "found int", "prompt"),
    (one(prompt=1.5), "found float", "prompt"),
    (one(prompt=True), "found bool", "prompt"),
    (one(prompt={"text": "w1"}), "found dict", "prompt"),
    (one(prompt=None), "Either prompt or prompt_embeds must be provided", "prompt"),
    (one(prompt=[1.5]), "found a list of float", "prompt"),
    (one(prompt=[None]), "found a list of NoneType", "prompt"),
    (one(prompt=[[[1]]]), "found a list of list", "prompt"),
    (one(prompt=[[1], "w1"]), "found a list of list, str", "prompt"),
    (one(prompt=[[1, "a"]]), "found a list of list", "prompt"),
    (one(prompt=[[True]]), "found a list of list", "prompt"),
    (one(prompt=[2**63]), f"Token id {2**63} is out of vocabulary", "prompt"),
    (one(max_tokens="2"), "Expected `int | null`, got `str`", "max_tokens"),
    (one(max_tokens=2.0), "got `float`", "max_tokens"),
    (one(max_tokens=False), "got `bool`", "max_tokens"),
    (one(max_tokens=[2]), "got `array`", "max_tokens"),
    (one(max_tokens=-1), "Expected `int` >= 0", "max_tokens"),
    (one(max_tokens=0), "max_tokens must be at least 1", "max_tokens"),
    (one(max_tokens=10**18), f"max_tokens={10**18} cannot be greater than", "max_tokens"),
    (one(temperature="0"), "Expected `float | null`, got `str`", "temperature"),
    (one(temperature=True), "got `bool`", "temperature"),
    (one(temperature=-1), "temperature=-1.0 is not supported", "temperature"),
    (one(temperature=1e308), "temperature=1e+308 is not supported", "temperature"),
    (one(stream="true"), "Expected `bool | null`, got `str`", "stream"),
    (one(stream=1), "got `int`", "stream"),
    (one(stream_options=True), "got `bool`", "stream_options"),
    (
        one(stream=True, stream_options={"include_usage": "y"}),
        "got `str`",
        "stream_options.include_usage",
    ),
    (one(n=2), "n=2 is not supported: one choice per prompt", "n"),
    (one(n=0), "n=0 is not supported", "n"),
    (one(n="1"), "Expected `int`, got `str`", "n"),
    (one(n=1.0), "Expected `int`, got `float`", "n"),
    (one(n=None), "Expected `int`, got `null`", "n"),
    (one(logprobs=1), "logprobs=1 is not supported", "logprobs"),
    (one(logprobs=0), "logprobs=0 is not supported", "logprobs"),
    (one(logprobs=True), "got `bool`", "logprobs"),
    (one(logprobs="5"), "got `str`", "logprobs"),
    (one(echo=1), "got `int`", "echo"),
    (one(best_of="2"), "got `str`", "best_of"),
    (one(top_p="1"), "got `str`", "top_p"),
    (one(top_k=1.5), "got `float`", "top_k"),
    (one(stop=1), "got `int`", "stop"),
    (one(stop=[1]), "got `int`", "stop[0]"),
    (one(stop_token_ids="4"), "got `str`", "stop_token_ids"),
    (one(stop_token_ids=[1.5]), "got `float`", "stop_token_ids[0]"),
    (one(stop_token_ids=[True]), "got `bool`", "stop_token_ids[0]"),
    (one(stop_token_ids=[-1]), "Expected `int` >= 0", "stop_token_ids[0]"),
    (one(ignore_eos="yes"), "got `str`", "ignore_eos"),
    (one(ignore_eos=None), "got `null`", "ignore_eos"),
    (one(return_token_ids=1), "got `int`", "return_token_ids"),
    (one(logit_bias=[]), "got `array`", "logit_bias"),
    (one(logit_bias={"1": "a"}), "got `str`", "logit_bias[...]"),
    (one(min_tokens="0"), "got `str`", "min_tokens"),
    (one(seed="x"), "got `str`", "seed"),
    (one(user=1), "got `int`", "user"),
    (one(suffix=1), "got `int`", "suffix"),
    (one(model=1), "got `int`", "model"),
    (one(request_id=1), "got `int`", "request_id"),
    (one(request_id=""), "length >= 1", "request_id"),
    (one(request_id="r" * 129), "length <= 128", "request_id"),
    (["prompt", [1]], "must be a JSON object, found list", None),
    ("w1 w2", "must be a JSON object, found str", None),
    (None, "must be a JSON object, found NoneType", None),
]


def refused(api: Api, content: bytes, headers: dict[str, str], status: int) -> dict[str, object]:
    before = api.state()
    answer = api.client.post(COMPLETIONS, content=content, headers=headers)
    assert answer.status_code == status, answer.text
    info = error_object(answer)
    assert api.state() == before, "a refused completion reached the serving loop"
    return info


@pytest.mark.parametrize(("body", "needle", "param"), WRONG)
def test_wrong_types_for_every_field_are_400_naming_it(
    api: Api, body: object, needle: str, param: str | None
) -> None:
    info = refused(api, msgspec.json.encode(body), JSON, 400)
    assert needle in str(info["message"]), info["message"]
    assert (info["type"], info["param"]) == ("BadRequestError", param)


@pytest.mark.parametrize(
    ("body", "needle", "param"),
    [
        (one(prompt=[1] * (MAX_LEN + 1)), "your prompt contains 65 input tokens", "input_tokens"),
        (one(prompt=[1] * 100_000), "your prompt contains 100000 input tokens", "input_tokens"),
        (one(prompt=[[1]] * 10_000), "prompt list length 10000 exceeds", "prompt"),
        (one(prompt=[1] * MAX_LEN, max_tokens=None), "no room is left", "input_tokens"),
        (one(prompt=[1] * 60, max_tokens=5), "you requested 65 tokens", "max_tokens"),
        (one(max_tokens=MAX_LEN + 1), "cannot be greater than max_model_len=64", "max_tokens"),
        (one(max_tokens=2**63 - 1), "cannot be greater than max_model_len=64", "max_tokens"),
    ],
)
def test_prompts_and_max_tokens_past_the_model_limits_are_400(
    api: Api, body: object, needle: str, param: str
) -> None:
    info = refused(api, msgspec.json.encode(body), JSON, 400)
    assert needle in str(info["message"]) and info["param"] == param


def test_a_huge_text_prompt_is_refused_before_it_is_tokenised(tmp_path: Path) -> None:
    tokenizer, _ = load_tokenizer(word_tokenizer(tmp_path / "ckpt"))
    api = Api(model=ServedModel("m", "/m", ModelLimits(VOCAB, MAX_LEN), tokenizer))
    text = "w1 " * (MAX_LEN * MAX_CHARS_PER_TOKEN)
    info = refused(api, msgspec.json.encode(one(prompt=text)), JSON, 400)
    assert "characters (more than 2048 characters" in str(info["message"])
    assert info["param"] == "input_text"


def test_unicode_and_nul_bytes_are_text_like_any_other(tmp_path: Path) -> None:
    """A NUL or a non-ASCII character is valid JSON text: served (its tokens are the
    tokenizer's), or refused naming the field, never a 5xx."""
    tokenizer, _ = load_tokenizer(word_tokenizer(tmp_path / "ckpt"))
    api = Api(model=ServedModel("m", "/m", ModelLimits(VOCAB, MAX_LEN), tokenizer))
    served = api.client.post(COMPLETIONS, json=one(prompt="w5\u0000 w6 ünïcødé 🙂"))
    assert served.status_code == 200, served.text
    ids = api.service.requests[-1].prompt_token_ids
    assert ids[0] == 5 and 6 in ids and set(ids) <= {0, 5, 6}, "unknown words are w0"
    info = refused(api, msgspec.json.encode(one(model="m\u0000")), JSON, 404)
    assert info["message"] == "The model `m\x00` does not exist. Valid aliases: m."
    info = refused(api, msgspec.json.encode(one(stop="\u0000")), JSON, 400)
    assert info["param"] == "stop"
    lone = b'{"prompt": "\\udc80 w1", "max_tokens": 1}'  # a lone surrogate is not text
    assert "Invalid JSON format" in str(refused(api, lone, JSON, 400)["message"])


def test_unknown_fields_are_ignored_as_vllm_and_openai_ignore_them(api: Api) -> None:
    body = one(frobnicate={"x": [1]}, tools=[], response_format="json", **{"é\u0000": None})
    answer = api.client.post(COMPLETIONS, json=body)
    assert answer.status_code == 200, answer.text
    assert [r.prompt_token_ids for r in api.service.requests] == [(1, 2)]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "Invalid JSON format"),
        (b"{oops", "Invalid JSON format"),
        (b'{"prompt": [1], "max_tokens": NaN}', "Invalid JSON format"),
        (b'{"prompt": [1' + b"0" * 5000 + b"]}", "Invalid JSON format"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ],
)
def test_malformed_json_is_400(api: Api, content: bytes, needle: str) -> None:
    assert needle in str(refused(api, content, JSON, 400)["message"])


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/jsonl", ""])
def test_a_wrong_content_type_is_400(api: Api, content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    info = refused(api, msgspec.json.encode(one()), headers, 400)
    assert "Only 'application/json' is allowed" in str(info["message"])


def test_a_body_over_the_bound_is_413_and_never_served(api: Api) -> None:
    body = msgspec.json.encode(one(user="x" * MAX_BODY_BYTES))
    info = refused(api, body, JSON, 413)
    assert info["type"] == "Request Entity Too Large"
    assert f"the limit is {MAX_BODY_BYTES} bytes" in str(info["message"])


def test_an_echoed_value_is_clipped(api: Api) -> None:
    for body in (one(model="m" * 1_000_000), one(stop=["x"] * 300_000)):
        answer = api.client.post(COMPLETIONS, json=body)
        assert answer.status_code in (400, 404)
        assert len(str(error_object(answer)["message"])) < 2 * MAX_ECHO_CHARS + 300
