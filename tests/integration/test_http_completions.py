"""OpenAI completions on a real ``ftengine serve`` (DP=4), through the official ``openai``
client: text and token-id prompts, streaming, concurrent requests served concurrently with
the single-process reference's tokens, and bad requests refused at the edge with 400s that
never reach (or hurt) the engines. Answers are also decoded with vLLM's own types."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from ftengine.testbed.cluster import reference_generate
from ftengine.weights.checkpoint_gen import make_checkpoint
from tests.integration.serve_support import MODEL, SIZES, Server, Starter, metric

pytestmark = pytest.mark.integration

completion_protocol = pytest.importorskip(
    "vllm.entrypoints.openai.completion.protocol", reason="vllm is not installed"
)

VOCAB = 512  # make_checkpoint's default
PROMPTS = ([1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14])
MAX_TOKENS = 6
LONG_TOKENS = 300
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HTTP tests' checkpoint with a word-level tokenizer: token i is the word ``w<i>``."""
    path = make_checkpoint(tmp_path_factory.mktemp("completions-ckpt") / "model", **SIZES)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> list[list[int]]:
    generations = reference_generate(checkpoint, PROMPTS, MAX_TOKENS)
    long = reference_generate(checkpoint, [PROMPTS[0]], LONG_TOKENS)
    return [list(g.token_ids) for g in generations] + [list(long[0].token_ids)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[Server]:
    starter = Starter(tmp_path_factory.mktemp("completions-serve"), checkpoint)
    try:
        yield starter()
    finally:
        starter.stop_all()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def ids_of(choice: Any) -> list[int]:
    return list((choice.model_extra or {})["token_ids"])  # vLLM's field, not OpenAI's


@pytest.mark.timeout(240)
def test_text_and_token_prompts_streamed_or_not_give_the_reference(
    client: openai.OpenAI, reference: list[list[int]]
) -> None:
    [card] = client.models.list().data
    assert card.id == MODEL and (card.model_extra or {})["max_model_len"] == 4096
    plain = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, **GREEDY
    )
    assert plain.choices[0].finish_reason == "length"
    assert plain.choices[0].text == text(reference[0])
    assert plain.usage is not None and plain.usage.completion_tokens == MAX_TOKENS
    as_text = client.completions.create(
        model=MODEL,
        prompt=[text(p) for p in PROMPTS[1:3]],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert [ids_of(c) for c in as_text.choices] == reference[1:3]
    assert [(c.model_extra or {})["prompt_token_ids"] for c in as_text.choices] == list(
        map(list, PROMPTS[1:3])
    )
    stream = client.completions.create(
        model=MODEL,
        prompt=text(PROMPTS[3]),
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = list(stream)
    tokens = [t for chunk in chunks if chunk.choices for t in ids_of(chunk.choices[0])]
    assert tokens == reference[3]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text(reference[3])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


@pytest.mark.timeout(240)
def test_concurrent_requests_share_steps_and_each_gets_the_reference(
    server: Server, client: openai.OpenAI, reference: list[list[int]]
) -> None:
    """A long stream is still running when short requests, sent after it, have finished:
    they joined its steps instead of waiting for it (a synchronous batch would block)."""
    long: dict[str, Any] = {"tokens": []}
    streaming = threading.Event()

    def stream_long() -> None:
        chunks = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=LONG_TOKENS,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        for chunk in chunks:
            long["tokens"].extend(ids_of(chunk.choices[0]))
            streaming.set()
        long["ended"] = time.monotonic()

    thread = threading.Thread(target=stream_long)
    thread.start()
    short: dict[int, list[int]] = {}

    def one(index: int) -> None:
        answer = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[index],
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        short[index] = ids_of(answer.choices[0])

    assert streaming.wait(60), "the long request never streamed"
    workers = [threading.Thread(target=one, args=(i,)) for i in range(1, 4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    shorts_done = time.monotonic()
    thread.join(180)
    assert short == {i: reference[i] for i in range(1, 4)}
    assert long["tokens"] == reference[4]
    assert shorts_done < long["ended"], "the short requests waited for the long one"


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"prompt": [1, 2, 99999], "max_tokens": 5}, "Token id 99999 is out of vocabulary", "prompt"),
    ({"prompt": [1] * 4097}, "your prompt contains 4097 input tokens", "input_tokens"),
    ({"prompt": [1] * 4000, "max_tokens": 200}, "you requested 4200 tokens", "max_tokens"),
    (
        {"prompt": [1], "max_tokens": 5000},
        "cannot be greater than max_model_len=4096",
        "max_tokens",
    ),
    ({"prompt": [1], "temperature": 0.8}, "temperature=0.8 is not supported", "temperature"),
    ({"prompt": "w1 w2", "max_tokens": 2, "n": 3}, "n=3 is not supported", "n"),
]


@pytest.mark.timeout(240)
def test_bad_requests_are_400s_and_the_engines_never_see_them(
    server: Server, client: openai.OpenAI, reference: list[list[int]]
) -> None:
    """The issue's report: [1, 2, 99999] made every engine unhealthy; now it is a 400."""
    for body, needle, param in BAD:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, **body)
        assert info.value.status_code == 400 and info.value.param == param
        assert needle in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-2", prompt=[1], max_tokens=1)
    engines = server.engines().values()
    assert all(e["status"] == "healthy" and e["phase"] == "running" for e in engines)
    samples = server.metrics()
    assert sum(v for (name, _), v in samples.items() if name == "ftengine_faults_total") == 0
    assert metric(samples, "ftengine_completion_requests_total", outcome="rejected") >= len(BAD)
    answer = server.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "ignore_eos": True,
              "return_token_ids": True},
    )  # fmt: skip
    vllm_answer = completion_protocol.CompletionResponse.model_validate(answer.json())
    assert vllm_answer.choices[0].token_ids == reference[2]
    assert metric(server.metrics(), "ftengine_completions_total", finish_reason="length") >= 1
