"""Handing a DEAD engine core's held requests to a survivor, against vLLM's real
``Request``, ``SamplingParams`` and output types and a fake survivor: a real HTTP server
that checks each body against vLLM's own ``CompletionRequest`` fields and streams a
deterministic "model" in vLLM's SSE shape. The tokens reach the engine core's output queue
exactly as the fault-free run would have produced them (none missing, none repeated), from
a survivor that breaks its stream midway or after one that cannot be reached too; what
cannot resume exactly, a survivor's refusal and the recovery deadline abort with the
reason; the options are checked at start-up and the launcher gives each rank the others.
Without ``handoff_urls`` (the default) the survivors are found on a real ``TCPStore`` (the
kind vLLM's DP store is), where each rank publishes its API server's URL."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs
import pytest

from ftengine.errors import ConfigError
from ftengine.integrations.vllm.engine_core import handoff
from ftengine.integrations.vllm.engine_core.handoff import HANDOFF_ATTR, Handoff, refusal
from ftengine.integrations.vllm.engine_core.reinference import (
    abort,
    hold_or_abort,
    install,
    release_dead,
)
from ftengine.integrations.vllm.engine_core.survivors import (
    KEY,
    FixedSurvivors,
    SurvivorDirectory,
)
from ftengine.integrations.vllm.messages import API_KEY_ENV, API_URL_ENV
from ftengine.integrations.vllm.patches.engine_core import check_reinference_seams
from ftengine.testbed.vllm.launcher import DeploymentConfig
from tests.unit.test_vllm_reinference import (
    Engine,
    Executor,
    FakeScheduler,
    ParallelConfig,
    Sentinel,
    settings,
)

sampling = pytest.importorskip("vllm.sampling_params", reason="vLLM is not installed")
vllm_request = pytest.importorskip("vllm.v1.request")
v1 = pytest.importorskip("vllm.v1.engine")
protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")

DEAD = "recovery ended DEAD, the held request cannot resume: engine 1's worker process died"


@attrs.define
class ModelConfig:
    """``ModelConfig``'s names the handoff reads."""

    served_model_name: str | list[str] | None = attrs.field(factory=lambda: ["tiny-served"])
    model: str = "/ckpt"


@attrs.define
class VllmConfig:
    model_config: ModelConfig = attrs.field(factory=ModelConfig)
    parallel_config: ParallelConfig = attrs.field(factory=lambda: ParallelConfig(0, 2))


@attrs.define
class ServingEngine(Engine):
    """The engine stand-in with the ``vllm_config`` the handoff reads its model name from."""

    vllm_config: VllmConfig = attrs.field(factory=VllmConfig)


def next_token(sequence: list[int]) -> int:
    """The fake survivor's greedy model: a deterministic function of the whole sequence."""
    return (sum(sequence) * 31 + len(sequence)) % 512


def fault_free(prompt: list[int], n: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(n):
        sequence.append(next_token(sequence))
    return sequence[len(prompt) :]


@attrs.define
class Survivor:
    """What the fake survivor answers, ask by ask: "ok", "break:N" (N tokens, then the
    connection closes without a finish reason) or an HTTP status code; then "ok"."""

    script: list[str] = attrs.field(factory=list)
    bodies: list[dict[str, Any]] = attrs.field(factory=list)
    auth: list[str | None] = attrs.field(factory=list)  # each ask's Authorization header
    url: str = ""

    def next_move(self) -> str:
        return self.script.pop(0) if self.script else "ok"


def handler(survivor: Survivor) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_POST(self) -> None:
            assert self.path == "/v1/completions", self.path
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            unknown = set(body) - set(protocol.CompletionRequest.model_fields)
            assert not unknown, f"not vLLM CompletionRequest fields: {unknown}"
            request = protocol.CompletionRequest.model_validate(body)
            survivor.bodies.append(body)
            survivor.auth.append(self.headers.get("Authorization"))
            move = survivor.next_move()
            if move.isdigit():
                self.send_response(int(move))
                self.end_headers()
                self.wfile.write(b'{"error": {"message": "no such model"}}')
                return
            stop_after = int(move.split(":")[1]) if move.startswith("break:") else None
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            sequence = list(request.prompt)
            for i in range(request.max_tokens or 0):
                if stop_after is not None and i == stop_after:
                    return  # connection closes mid-stream
                sequence.append(next_token(sequence))
                last = i == (request.max_tokens or 0) - 1
                choice = {"index": 0, "text": "x", "token_ids": [sequence[-1]]}
                choice |= {"finish_reason": "length" if last else None, "stop_reason": None}
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


@pytest.fixture
def survivor() -> Iterator[Survivor]:
    found = Survivor()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(found))
    found.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield found
    server.shutdown()
    server.server_close()


def request(rid: str, prompt: list[int], emitted: int, max_tokens: int, **params: Any) -> Any:
    """A real vLLM request that already emitted its first ``emitted`` fault-free tokens."""
    params = {"temperature": 0.0, "ignore_eos": True} | params
    made = vllm_request.Request(
        rid, prompt, sampling.SamplingParams(max_tokens=max_tokens, **params), None, client_index=1
    )
    made.append_output_token_ids(fault_free(prompt, emitted))
    return made


def dead_engine(*requests: Any) -> Engine:
    return Engine(FakeScheduler(list(requests), []), model_executor=Executor(is_failed=True))


def hand_off(urls: list[str], engine: Engine, deadline_s: float = 30.0) -> Handoff:
    held = list(engine.scheduler.requests.values())
    ho = Handoff(FixedSurvivors(tuple(urls)), "tiny", deadline_s)
    for reason, refused in ho.take(engine, held, DEAD).items():
        abort(engine, refused, reason)  # as re-inference's hold_or_abort does
    finish(ho)
    return ho


def finish(ho: Handoff) -> None:
    """Every handed-off request ended; the watch for late arrivals stopped."""
    ho.stopped.set()
    assert ho.late is not None
    ho.late.join(timeout=30)
    for thread in ho.threads:
        thread.join(timeout=30)
        assert not thread.is_alive()


def outputs(engine: Engine) -> dict[str, list[Any]]:
    """Per request id, every ``EngineCoreOutput`` the engine core queued (client 1's)."""
    found: dict[str, list[Any]] = {}
    while not engine.output_queue.empty():
        client, batch = engine.output_queue.get_nowait()
        assert client == 1 and isinstance(batch, v1.EngineCoreOutputs)
        for output in batch.outputs:
            found.setdefault(output.request_id, []).append(output)
            if output.finish_reason is not None:
                assert batch.finished_requests == {output.request_id}
    return found


def streamed(outs: list[Any]) -> list[int]:
    return [t for out in outs for t in out.new_token_ids]


def test_a_held_greedy_request_ends_on_the_survivor_with_exactly_the_fault_free_tokens(
    survivor: Survivor,
) -> None:
    engine = dead_engine(request("a", [1, 2, 3], emitted=3, max_tokens=10, min_tokens=5))
    hand_off([survivor.url], engine)
    assert engine.scheduler.requests == {}  # out of the DEAD scheduler, no abort sent
    outs = outputs(engine)["a"]
    assert streamed(outs) == fault_free([1, 2, 3], 10)[3:]
    assert [len(o.new_token_ids) for o in outs] == [1] * 7  # one output per survivor chunk
    assert outs[-1].finish_reason == v1.FinishReason.LENGTH
    assert all(o.finish_reason is None for o in outs[:-1])
    [body] = survivor.bodies
    assert body["prompt"] == [1, 2, 3, *fault_free([1, 2, 3], 3)]
    assert (body["max_tokens"], body["min_tokens"], body["temperature"]) == (7, 2, 0.0)
    assert body["stream"] and body["return_token_ids"] and body["ignore_eos"]


def test_a_stream_cut_short_is_asked_again_from_the_tokens_already_out(
    survivor: Survivor,
) -> None:
    survivor.script = ["break:2", "break:0"]
    engine = dead_engine(request("b", [7, 8], emitted=1, max_tokens=9))
    hand_off([survivor.url], engine)
    outs = outputs(engine)["b"]
    assert streamed(outs) == fault_free([7, 8], 9)[1:]  # no gap, no repeat
    assert outs[-1].finish_reason == v1.FinishReason.LENGTH
    assert [b["max_tokens"] for b in survivor.bodies] == [8, 6, 6]
    assert survivor.bodies[2]["prompt"] == [7, 8, *fault_free([7, 8], 3)]


def test_an_unreachable_survivor_is_skipped_for_the_next_one(survivor: Survivor) -> None:
    survivor.script = ["503"]
    engine = dead_engine(request("c", [4], emitted=2, max_tokens=5))
    hand_off(["http://127.0.0.1:9", survivor.url], engine)  # port 9: nothing listens
    outs = outputs(engine)["c"]
    assert streamed(outs) == fault_free([4], 5)[2:]
    assert len(survivor.bodies) == 2  # the 503, then the answer (the dead URL in between)


def test_what_cannot_resume_exactly_is_aborted_saying_why(survivor: Survivor) -> None:
    seeded = request("s", [1], emitted=1, max_tokens=5, temperature=0.8, seed=7)
    logprobs = request("l", [1], emitted=1, max_tokens=5, logprobs=2)
    penalty = request("p", [1], emitted=1, max_tokens=5, presence_penalty=0.5)
    greedy = request("g", [1], emitted=1, max_tokens=5)
    engine = dead_engine(seeded, logprobs, penalty, greedy)
    hand_off([survivor.url], engine)
    outs = outputs(engine)
    for rid, why in (("s", "temperature 0.8 with seed 7"), ("l", "logprobs"), ("p", "presence")):
        [out] = outs[rid]
        assert out.finish_reason == v1.FinishReason.ABORT and out.new_token_ids == []
        assert out.stop_reason.startswith(DEAD + "; not handed to a survivor: ")
        assert why in out.stop_reason, out.stop_reason
    assert streamed(outs["g"]) == fault_free([1], 5)[1:]
    assert [b["prompt"] for b in survivor.bodies] == [[1, fault_free([1], 1)[0]]]


def test_a_survivors_refusal_and_the_deadline_abort_with_the_reason(survivor: Survivor) -> None:
    survivor.script = ["400"]
    engine = dead_engine(request("r", [1, 2], emitted=1, max_tokens=4))
    hand_off([survivor.url], engine)
    [out] = outputs(engine)["r"]
    assert out.finish_reason == v1.FinishReason.ABORT
    assert "refused" in out.stop_reason and "answered 400" in out.stop_reason
    assert "no such model" in out.stop_reason
    survivor.script = ["503"] * 100
    engine = dead_engine(request("t", [1, 2], emitted=1, max_tokens=4))
    hand_off([survivor.url], engine, deadline_s=handoff.MARGIN_S + 1.2)
    [out] = outputs(engine)["t"]
    assert out.finish_reason == v1.FinishReason.ABORT
    assert "did not finish within the 2.2s recovery deadline" in out.stop_reason
    # asked again until the deadline (how often depends on the machine: at least once)
    assert "answered 503" in out.stop_reason and 1 <= len(survivor.bodies) - 1 <= 4


def test_a_dead_engine_with_survivors_hands_its_held_requests_over(survivor: Survivor) -> None:
    """Through re-inference's ``on_fault``: handed off, not aborted (without
    ``handoff_urls`` test_vllm_reinference shows the abort)."""
    held = request("h", [3, 1], emitted=2, max_tokens=6)
    engine = ServingEngine(FakeScheduler([held], []), model_executor=Executor(is_failed=True))
    sentinel = Sentinel(engine)
    options = settings(reinference=True, handoff_urls=[survivor.url])
    install(sentinel, options, check_reinference_seams)
    hold_or_abort(sentinel, RuntimeError("worker died"), None)
    assert sentinel.status_type == v1.EngineStatusType.DEAD
    ho: Handoff = getattr(sentinel, HANDOFF_ATTR)
    assert ho.model == "tiny-served" and ho.deadline_s == options.recovery_timeout_s
    finish(ho)
    outs = outputs(sentinel.engine)["h"]
    assert streamed(outs) == fault_free([3, 1], 6)[2:]
    assert outs[-1].finish_reason == v1.FinishReason.LENGTH


def test_an_engine_dead_after_a_failed_scale_down_hands_its_held_requests_over(
    survivor: Survivor,
) -> None:
    """Issue 30: a survivor whose ``scale_down`` failed for good is DEAD while the other
    survivors serve: what it held (a peer's fault) resumes there, not aborted."""
    held = request("h", [3, 1], emitted=2, max_tokens=6)
    engine = ServingEngine(FakeScheduler([held], []), model_executor=Executor(is_failed=False))
    sentinel = Sentinel(engine)
    install(sentinel, settings(reinference=True, handoff_urls=[survivor.url]),
            check_reinference_seams)  # fmt: skip
    hold_or_abort(sentinel, RuntimeError("Connection closed by peer"), None)
    assert sentinel.status_type == v1.EngineStatusType.UNHEALTHY and outputs(engine) == {}
    release_dead(sentinel, "engine 1's scale_down failed: 1/2 clients joined")
    finish(getattr(sentinel, HANDOFF_ATTR))
    outs = outputs(sentinel.engine)["h"]
    assert streamed(outs) == fault_free([3, 1], 6)[2:]
    assert outs[-1].finish_reason == v1.FinishReason.LENGTH


def test_the_served_model_name_falls_back_to_the_model() -> None:
    assert handoff.served_model(VllmConfig(ModelConfig(None))) == "/ckpt"
    assert handoff.served_model(VllmConfig(ModelConfig("name"))) == "name"


def test_a_greedy_request_with_the_supported_fields_is_accepted() -> None:
    plain = request("ok", [1], emitted=0, max_tokens=3, stop_token_ids=[5], min_tokens=1)
    assert refusal(plain) is None
    assert refusal(request("rep", [1], emitted=0, max_tokens=3, repetition_penalty=1.2)) is None


@pytest.mark.parametrize(
    ("urls", "message"),
    [
        ("http://a:1", "must be a list of URLs"),
        (["ftp://a:1"], "expected http(s)://host:port"),
        (["http://a"], "expected http(s)://host:port"),
        (["http://a:1/v1"], "without a path"),
        (["http://a:1", "http://a:1/"], "each URL at most once"),
    ],
)
def test_handoff_urls_are_checked_at_start_up(urls: object, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        settings(reinference=True, handoff_urls=urls)


def test_handoff_urls_need_reinference() -> None:
    with pytest.raises(ConfigError, match=r"handoff_urls needs ftengine\.reinference: true"):
        settings(reinference=False, handoff_urls=["http://a:1"])
    assert settings(reinference=True, handoff_urls=["http://a:1/"]).handoff_urls == ("http://a:1",)
    assert settings(handoff_urls=["http://a:1"]).handoff_urls == ("http://a:1",)  # on by default


def test_the_launcher_gives_each_rank_the_others_urls(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    options = {"ftengine": {"reinference": True}}
    config = DeploymentConfig(tmp_path, dp_size=3, port=8100, additional_config=options)
    assert "handoff_urls" not in config.additional(0)["ftengine"]  # type: ignore[operator]
    config = attrs.evolve(config, handoff=True)
    argv = config.argv(1, 9999)
    sent = json.loads(argv[argv.index("--additional-config") + 1])
    urls = ["http://127.0.0.1:8100", "http://127.0.0.1:8102"]
    assert sent == {"ftengine": {"reinference": True, "handoff_urls": urls}}
    off = {"ftengine": {"reinference": False}}
    with pytest.raises(ConfigError, match=r"handoff_urls needs ftengine\.reinference"):
        DeploymentConfig(tmp_path, dp_size=2, handoff=True, additional_config=off)
    assert DeploymentConfig(tmp_path, dp_size=2, handoff=True).handoff  # re-inference by default
    with pytest.raises(ConfigError, match="dp_size must be >= 2, found 1"):
        DeploymentConfig(tmp_path, dp_size=1, handoff=True, additional_config=options)


def test_the_vllm_fields_the_handoff_reads_are_where_it_expects_them() -> None:
    """A renamed sampling field would silently stop being refused; a renamed request field
    would fail only at a fault: both fail here first."""
    fields = set(sampling.SamplingParams.__struct_fields__)
    assert set(handoff.NOT_EXACT) <= fields, set(handoff.NOT_EXACT) - fields
    assert {"temperature", "seed", "min_tokens", "ignore_eos", "stop_token_ids"} <= fields
    assert {"repetition_penalty"} <= fields
    body = handoff.resume_state(request("x", [1], emitted=0, max_tokens=2)).body([], "m")
    assert set(body) <= set(protocol.CompletionRequest.model_fields)
    assert {"STOP", "LENGTH", "ABORT"} <= set(v1.FinishReason.__members__)


@pytest.fixture
def dp_store() -> Iterator[Any]:
    """A real ``torch.distributed.TCPStore``, the kind vLLM's DP store is (a ``get`` of a
    missing key blocks, here for at most 2 s)."""
    dist = pytest.importorskip("torch.distributed")
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=2)
    )
    yield store


@attrs.define
class DpEngine(ServingEngine):
    """A DP rank's engine core: with the DP store vLLM's ``DPEngineCoreProc`` keeps."""

    dp_store: Any = None


def dp_engine(store: Any, rank: int, world: int, *requests: Any) -> DpEngine:
    """A rank of a ``world``-rank deployment on ``store``; DEAD when it holds ``requests``."""
    config = VllmConfig(parallel_config=ParallelConfig(rank, world))
    return DpEngine(
        FakeScheduler(list(requests), []), model_executor=Executor(is_failed=bool(requests)),
        vllm_config=config, dp_store=store,
    )  # fmt: skip


def test_without_handoff_urls_a_dead_rank_finds_its_survivor_on_the_dp_store(
    survivor: Survivor, dp_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default: each rank's engine core publishes its API server's URL (exported by
    that server) on the DP store; a DEAD one hands its held requests to the others'."""
    monkeypatch.setenv(API_URL_ENV, survivor.url)
    monkeypatch.setenv(API_KEY_ENV, "sk-deployment")  # exported by each rank's server
    peer = Sentinel(dp_engine(dp_store, 0, 3))
    install(peer, settings(), check_reinference_seams)  # rank 0 publishes at start-up
    monkeypatch.setenv(API_URL_ENV, "http://127.0.0.1:9")  # rank 1 is the one that dies
    dead = Sentinel(dp_engine(dp_store, 1, 3, request("d", [2, 5], emitted=1, max_tokens=5)))
    install(dead, settings(), check_reinference_seams)
    directory = getattr(dead, HANDOFF_ATTR).survivors
    assert isinstance(directory, SurvivorDirectory)
    assert directory() == (survivor.url,)  # rank 2 published nothing, its own URL skipped
    hold_or_abort(dead, RuntimeError("worker died"), None)
    finish(getattr(dead, HANDOFF_ATTR))
    outs = outputs(dead.engine)["d"]
    assert streamed(outs) == fault_free([2, 5], 5)[1:]
    assert outs[-1].finish_reason == v1.FinishReason.LENGTH
    assert survivor.auth == ["Bearer sk-deployment"]  # the survivor's --api-key


def test_each_rank_publishes_once_per_store_and_reads_the_others_from_the_next_on(
    dp_store: Any,
) -> None:
    engines = [dp_engine(dp_store, r, 4) for r in range(4)]
    directories = [SurvivorDirectory(e, r, 4, f"http://h{r}:1") for r, e in enumerate(engines)]
    for directory in directories[:3]:
        directory.publish()
    assert directories[2]() == ("http://h0:1", "http://h1:1")  # ring order; rank 3 absent
    assert directories[0]() == ("http://h1:1", "http://h2:1")
    dp_store.set(KEY.format(rank=1), "http://other:2")
    directories[1].publish()  # the same store: no write
    assert directories[0]() == ("http://other:2", "http://h2:1")
    fresh = pytest.importorskip("torch.distributed").TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=2)
    )
    engines[1].dp_store = fresh  # a retry's new store
    directories[1].publish()
    assert bytes(fresh.get(KEY.format(rank=1))).decode() == "http://h1:1"
    # rank 3 (no URL of its own) still reads the old store, where rank 1's key is as it was
    assert SurvivorDirectory(engines[3], 3, 4, None)() == (
        "http://h0:1", "http://other:2", "http://h2:1",
    )  # fmt: skip


def test_a_status_push_on_a_new_store_publishes_the_url_and_a_failing_store_only_warns(
    dp_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    engine = dp_engine(dp_store, 0, 2)
    sentinel = Sentinel(engine)
    directory = SurvivorDirectory(engine, 0, 2, "http://me:1")
    setattr(sentinel, HANDOFF_ATTR, Handoff(directory, "m", 10.0))
    handoff.publish_url(sentinel)
    assert bytes(dp_store.get(KEY.format(rank=0))).decode() == "http://me:1"

    class Broken:
        def set(self, key: str, value: str) -> None:
            raise RuntimeError("connection reset by peer")  # torch's DistStoreError is one

    engine.dp_store = Broken()
    handoff.publish_url(sentinel)
    assert "could not publish its API server's URL" in caplog.text


def test_a_store_closed_by_the_survivors_scale_down_falls_back_on_the_board(
    dp_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Measured in CI: the survivors scaled rank 2 down 2 s before vLLM made it DEAD, and
    its store then answered "Broken pipe": its held requests were aborted. The URLs its
    agent last read on the DP board hand them off instead."""

    class Closed:
        def check(self, keys: list[str]) -> bool:
            raise RuntimeError("Broken pipe")  # torch's DistNetworkError is a RuntimeError

    engine = dp_engine(dp_store, 2, 3)
    engine.dp_store = Closed()
    board = {0: "http://h0:1", 1: "http://h1:1"}
    assert SurvivorDirectory(engine, 2, 3, "http://h2:1", last_read=lambda: board)() == (
        "http://h0:1", "http://h1:1",
    )  # fmt: skip
    assert "using the API servers last read on the DP board" in caplog.text
    with pytest.raises(RuntimeError, match="Broken pipe"):  # nothing read: the store's error
        SurvivorDirectory(engine, 2, 3, "http://h2:1", last_read=dict)()


def test_a_new_store_nobody_wrote_on_yet_falls_back_on_the_board(
    dp_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Measured on hosts (chaos-vllm --hosts 2, seed 22): rank 1's worker killed during the
    survivors' scale-down past host 1; its engine core read the scale-down's new store,
    where rank 0 had not yet written its URL, and aborted its held requests ("none
    published one"). The board's URLs hand them off; a store that holds some wins."""
    engine = dp_engine(dp_store, 1, 3)
    board = {0: "http://h0:1", 2: "http://h2:1"}
    directory = SurvivorDirectory(engine, 1, 3, "http://h1:1", last_read=lambda: board)
    assert directory() == ("http://h2:1", "http://h0:1")
    assert "no API server published on the current DP store yet" in caplog.text
    dp_store.set(KEY.format(rank=0), "http://new0:1")
    assert directory() == ("http://new0:1",)
    assert SurvivorDirectory(engine, 1, 3, "http://h1:1", last_read=dict)() == ("http://new0:1",)
    empty = dp_engine(
        pytest.importorskip("torch.distributed").TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=2)
        ),
        1,
        3,
    )
    assert SurvivorDirectory(empty, 1, 3, "http://h1:1", last_read=dict)() == ()


def test_the_board_carries_each_engines_api_server() -> None:
    from ftengine.integrations.vllm.engine_core.dp_board import Entry, StatusBoard
    from tests.unit.test_vllm_engine_agent import Store

    store = Store()
    zero, one = StatusBoard(0, 2), StatusBoard(1, 2)
    one.api_url = "http://h1:1"
    one.publish(store, Entry("healthy", 0), 1, 0.0)
    zero.read(store)
    assert zero.api_urls == {1: "http://h1:1"}


def test_with_no_survivor_known_a_dead_rank_aborts_saying_why(dp_store: Any) -> None:
    """Nobody published (or the DP store fails): aborted at once with the reason, not left
    to the recovery deadline."""
    engine = dp_engine(dp_store, 1, 2, request("n", [1], emitted=1, max_tokens=4))
    ho = Handoff(SurvivorDirectory(engine, 1, 2, None), "m", 30.0)
    ho.take(engine, list(engine.scheduler.requests.values()), DEAD)
    finish(ho)
    [out] = outputs(engine)["n"]
    assert out.finish_reason == v1.FinishReason.ABORT
    assert out.stop_reason == (
        f"{DEAD}; not handed to a survivor: no other rank's API server is known (none "
        "published one on the DP store)"
    )


def test_a_single_rank_deployment_installs_no_handoff() -> None:
    engine = ServingEngine(
        FakeScheduler([], []), vllm_config=VllmConfig(parallel_config=ParallelConfig(0, 1))
    )
    sentinel = Sentinel(engine)
    install(sentinel, settings(), check_reinference_seams)
    assert not hasattr(sentinel, HANDOFF_ATTR)


def test_a_request_that_reaches_the_dead_engine_core_after_its_fault_is_handed_off(
    survivor: Survivor,
) -> None:
    """Sent before its API server learned the engine is DEAD, a request waits in the input
    queue nothing reads any more: handed off as the held ones are (or aborted saying why);
    what else waits there goes back in order."""
    engine = dead_engine(request("held", [1, 2], emitted=1, max_tokens=4))
    add, utility = v1.EngineCoreRequestType.ADD, v1.EngineCoreRequestType.UTILITY
    ho = Handoff(FixedSurvivors((survivor.url,)), "tiny", 30.0)
    ho.take(engine, list(engine.scheduler.requests.values()), DEAD)
    late = request("late", [6, 6, 6], emitted=0, max_tokens=5)
    sampled = request("sampled", [6], emitted=0, max_tokens=5, temperature=0.7)
    call = (0, 1, "get_supported_tasks", ())
    for item in ((add, (late, 0)), (utility, call), (add, (sampled, 0))):
        engine.input_queue.put_nowait(item)
    deadline = time.monotonic() + 30
    while not (engine.input_queue.empty() and len(survivor.bodies) >= 2):  # all taken
        assert time.monotonic() < deadline, survivor.bodies
        time.sleep(0.05)
    finish(ho)  # (an item taken is dealt with before the watch looks at ``stopped``)
    outs = outputs(engine)
    assert streamed(outs["late"]) == fault_free([6, 6, 6], 5)
    assert outs["late"][-1].finish_reason == v1.FinishReason.LENGTH
    [refused] = outs["sampled"]
    assert refused.finish_reason == v1.FinishReason.ABORT and "temperature 0.7" in str(
        refused.stop_reason
    )
    assert engine.input_queue.get_nowait() == (utility, call) and engine.input_queue.empty()
