"""``/v1/completions`` and ``/v1/models`` over a stand-in serving loop: every bad input is
vLLM's 400 naming the field (and nothing is submitted), and the answers, streamed or not,
have OpenAI's / vLLM's shape with every finish reason."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, models, pre_tokenizers

from ftengine.testbed.control.app import create_app
from ftengine.testbed.control.openai_routes import Completions
from ftengine.testbed.control.served_model import ServedModel, load_tokenizer
from ftengine.testbed.model_limits import ModelLimits
from tests.unit.control_standin import (
    POISON,
    VOCAB,
    StandInCluster,
    StandInService,
    standin_model,
)

COMPLETIONS = "/v1/completions"


class Harness:
    def __init__(self, model: ServedModel | None = None) -> None:
        self.cluster = StandInCluster()
        self.service = StandInService(self.cluster)
        self.model = model or standin_model()
        app = create_app(self.cluster, completions=Completions(self.service, self.model))
        self.client = TestClient(app)

    def post(self, body: object) -> Any:
        return self.client.post(COMPLETIONS, json=body)

    def stream(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        answer = self.post({**body, "stream": True})
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        data = [part.removeprefix("data: ") for part in answer.text.split("\n\n") if part]
        assert data[-1] == "[DONE]"
        return [msgspec.json.decode(item) for item in data[:-1]]


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness()
    with harness.client:
        yield harness


def word_tokenizer(path: Path) -> Path:
    """A word-level tokenizer whose token i is the word ``w<i>`` (like the checkpoints')."""
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


LONG = [1] * 65
BAD: list[tuple[object, str, str | None]] = [
    ({"prompt": [1, 2, 99999], "max_tokens": 5}, "Token id 99999 is out of vocabulary", "prompt"),
    ({"prompt": [-1]}, "Token id -1 is out of vocabulary", "prompt"),
    ({"prompt": [[1], [2, 99999]]}, "Token id 99999 is out of vocabulary", "prompt"),
    ({"prompt": LONG}, "your prompt contains 65 input tokens", "input_tokens"),
    ({"prompt": [1] * 64, "max_tokens": None}, "no room is left", "input_tokens"),
    ({"prompt": [1] * 60, "max_tokens": 10}, "you requested 70 tokens", "max_tokens"),
    ({"prompt": [1], "max_tokens": 65}, "cannot be greater than max_model_len=64", "max_tokens"),
    ({"prompt": [1], "max_tokens": 0}, "max_tokens must be at least 1", "max_tokens"),
    ({"prompt": [1], "max_tokens": -1}, "Expected `int` >= 0", "max_tokens"),
    ({"prompt": [1], "max_tokens": "5"}, "got `str`", "max_tokens"),
    ({"prompt": [1], "max_tokens": True}, "got `bool`", "max_tokens"),
    ({"prompt": [1], "max_tokens": 2.5}, "got `float`", "max_tokens"),
    ({}, "Either prompt or prompt_embeds must be provided", "prompt"),
    ({"prompt": ""}, "Either prompt or prompt_embeds must be provided", "prompt"),
    ({"prompt": []}, "Either prompt or prompt_embeds must be provided", "prompt"),
    ({"prompt": [[1], []]}, "prompt 1 is empty", "prompt"),
    ({"prompt": [1, "a"]}, "found a list of int, str", "prompt"),
    ({"prompt": [True]}, "found a list of bool", "prompt"),
    ({"prompt": {"x": 1}}, "found dict", "prompt"),
    ({"prompt": [[1]] * 65}, "prompt list length 65 exceeds the maximum", "prompt"),
    ({"prompt": "w1 w2"}, "prompt is text, but this server has no tokenizer", "prompt"),
    ({"prompt": [1], "temperature": 0.7}, "temperature=0.7 is not supported", "temperature"),
    ({"prompt": [1], "n": 2}, "n=2 is not supported", "n"),
    ({"prompt": [1], "best_of": 3}, "best_of=3", "best_of"),
    ({"prompt": [1], "use_beam_search": True}, "use_beam_search=True", "use_beam_search"),
    ({"prompt": [1], "echo": True}, "echo=True", "echo"),
    ({"prompt": [1], "logprobs": 1}, "logprobs=1", "logprobs"),
    ({"prompt": [1], "stop": "x"}, "use stop_token_ids", "stop"),
    ({"prompt": [1], "stop": ["x"]}, "use stop_token_ids", "stop"),
    ({"prompt": [1], "presence_penalty": 0.5}, "penalties", "presence_penalty"),
    ({"prompt": [1], "repetition_penalty": 1.2}, "penalties", "repetition_penalty"),
    ({"prompt": [1], "logit_bias": {"1": 2.0}}, "logit_bias", "logit_bias"),
    ({"prompt": [1], "min_tokens": 2}, "min_tokens", "min_tokens"),
    ({"prompt": [1], "suffix": "s"}, "suffix", "suffix"),
    (
        {"prompt": [1], "stream_options": {"include_usage": True}},
        "Stream options can only be defined when `stream=True`.",
        "stream_options",
    ),
    ({"prompt": [1], "stop_token_ids": [-1]}, "Expected `int` >= 0", "stop_token_ids[0]"),
    ({"prompt": [1], "request_id": ""}, "length >= 1", "request_id"),
    ([1, 2], "must be a JSON object, found list", None),
]


@pytest.mark.parametrize(("body", "needle", "param"), BAD)
def test_bad_input_is_a_400_naming_the_field_and_nothing_runs(
    h: Harness, body: object, needle: str, param: str | None
) -> None:
    answer = h.post(body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert needle in error["message"] and error["param"] == param
    assert (error["type"], error["code"]) == ("BadRequestError", 400)
    assert h.service.requests == []


def test_the_out_of_vocabulary_message_names_value_and_limit(h: Harness) -> None:
    message = h.post({"prompt": [1, 2, 99999], "max_tokens": 5}).json()["error"]["message"]
    assert message == (
        "Token id 99999 is out of vocabulary: this model has 1000 tokens (ids 0..999) "
        "(parameter=prompt, value=99999)"
    )


@pytest.mark.parametrize(
    ("content", "content_type", "needle"),
    [
        (b"{oops", "application/json", "Invalid JSON format"),
        (b'{"prompt": [1]}', "text/plain", "Only 'application/json' is allowed"),
    ],
)
def test_a_non_json_body_or_content_type_is_400(
    h: Harness, content: bytes, content_type: str, needle: str
) -> None:
    answer = h.client.post(COMPLETIONS, content=content, headers={"content-type": content_type})
    assert answer.status_code == 400 and needle in answer.json()["error"]["message"]


def test_an_unknown_model_is_404_as_vllm(h: Harness) -> None:
    answer = h.post({"model": "gpt-9", "prompt": [1]})
    assert answer.status_code == 404
    assert answer.json()["error"] == {
        "message": "The model `gpt-9` does not exist. Valid aliases: standin.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_a_completion_has_openais_shape(h: Harness) -> None:
    answer = h.post({"model": "standin", "prompt": [5, 6], "max_tokens": 3, "request_id": "r7"})
    assert answer.status_code == 200
    body = answer.json()
    assert body["id"] == "cmpl-r7" and body["object"] == "text_completion"
    assert body["model"] == "standin" and isinstance(body["created"], int)
    assert body["choices"] == [
        {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": None,
            "prompt_token_ids": None,
        }
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert h.service.requests[0].prompt_token_ids == (5, 6)


def test_return_token_ids_and_several_prompts(h: Harness) -> None:
    body = h.post({"prompt": [[5, 6], [9]], "max_tokens": 2, "return_token_ids": True}).json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["token_ids"] for c in choices] == [[7, 8], [10, 11]]
    assert [c["prompt_token_ids"] for c in choices] == [[5, 6], [9]]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_without_max_tokens_the_room_left_in_the_context_is_used(h: Harness) -> None:
    body = h.post({"prompt": [1] * 60, "max_tokens": None}).json()
    assert body["usage"]["completion_tokens"] == 4


def test_a_stop_id_finishes_with_stop_and_names_it(h: Harness) -> None:
    body = {"prompt": [1], "max_tokens": 9, "stop_token_ids": [4], "return_token_ids": True}
    choice = h.post(body).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 4)
    assert choice["token_ids"] == [2, 3, 4], "the stop token is kept, as vLLM keeps it"


def test_end_of_sequence_stops_unless_ignore_eos() -> None:
    model = ServedModel("m", "/m", ModelLimits(VOCAB, 64, eos_token_ids=frozenset({3})))
    h = Harness(model)
    eos = h.post({"prompt": [1], "max_tokens": 9, "return_token_ids": True}).json()["choices"][0]
    assert (eos["finish_reason"], eos["stop_reason"], eos["token_ids"]) == ("stop", None, [2, 3])
    body = {"prompt": [1], "max_tokens": 4, "ignore_eos": True}
    assert h.post(body).json()["choices"][0]["finish_reason"] == "length"


def test_an_aborted_request_answers_what_it_had_with_abort(h: Harness) -> None:
    h.service.abort_after = 2
    choice = h.post({"prompt": [1], "max_tokens": 5, "return_token_ids": True}).json()["choices"][0]
    assert (choice["finish_reason"], choice["token_ids"]) == ("abort", [2, 3])


def test_a_request_that_fails_in_a_worker_is_a_500(h: Harness) -> None:
    answer = h.post({"prompt": [POISON], "max_tokens": 2})
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["type"] == "InternalServerError" and "poisoned" in error["message"]


def test_while_the_cluster_recovers_completions_are_503(h: Harness) -> None:
    h.cluster.kill(2)
    answer = h.post({"prompt": [1]})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["type"] == "ServiceUnavailableError"


def test_a_stream_is_one_chunk_per_token_then_done(h: Harness) -> None:
    events = h.stream({"prompt": [5, 6], "max_tokens": 3, "request_id": "s"})
    assert len(events) == 3
    assert {e["id"] for e in events} == {"cmpl-s"}
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events)
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]


def test_a_stream_with_token_ids_and_usage(h: Harness) -> None:
    body = {"prompt": [5, 6], "max_tokens": 3, "return_token_ids": True}
    events = h.stream({**body, "stream_options": {"include_usage": True}})
    assert [e["choices"][0]["token_ids"] for e in events[:-1]] == [[7], [8], [9]]
    assert [e["choices"][0]["prompt_token_ids"] for e in events[:-1]] == [[5, 6], None, None]
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    continuous = h.stream({**body, "stream_options": {"continuous_usage_stats": True}})
    assert [e["usage"]["completion_tokens"] for e in continuous] == [1, 2, 3, 3]


def test_a_stream_of_several_prompts_indexes_its_chunks(h: Harness) -> None:
    events = h.stream({"prompt": [[1], [5]], "max_tokens": 2, "return_token_ids": True})
    by_index: dict[int, list[int]] = {}
    for event in events:
        choice = event["choices"][0]
        by_index.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert by_index == {0: [2, 3], 1: [6, 7]}


def test_a_stream_ends_with_abort_or_an_error_event(h: Harness) -> None:
    h.service.abort_after = 1
    aborted = h.stream({"prompt": [1], "max_tokens": 5})
    assert [e["choices"][0]["finish_reason"] for e in aborted] == [None, "abort"]
    failed = h.stream({"prompt": [POISON], "max_tokens": 5})
    assert len(failed) == 1 and failed[0]["error"]["type"] == "InternalServerError"


def test_text_prompts_and_text_answers_with_the_checkpoints_tokenizer(tmp_path: Path) -> None:
    tokenizer, _ = load_tokenizer(word_tokenizer(tmp_path / "ckpt"))
    assert tokenizer is not None
    h = Harness(ServedModel("m", "/m", ModelLimits(VOCAB, 64), tokenizer))
    body = h.post({"prompt": "w5 w6", "max_tokens": 3}).json()
    assert h.service.requests[0].prompt_token_ids == (5, 6)
    assert body["choices"][0]["text"] == "w7 w8 w9"
    events = h.stream({"prompt": ["w5 w6"], "max_tokens": 3})
    assert "".join(e["choices"][0]["text"] for e in events) == "w7 w8 w9"


def test_a_checkpoint_without_a_tokenizer_says_so(tmp_path: Path) -> None:
    assert load_tokenizer(tmp_path) == (None, "the checkpoint has no tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    tokenizer, note = load_tokenizer(tmp_path)
    assert tokenizer is None and "does not load" in note


def test_models_lists_the_served_model(h: Harness) -> None:
    body = h.client.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert (card["id"], card["object"], card["root"]) == (
        "standin",
        "model",
        "/checkpoints/standin",
    )
    assert card["max_model_len"] == 64
