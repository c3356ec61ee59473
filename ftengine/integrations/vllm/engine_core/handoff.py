"""Hand a DEAD vLLM engine core's held requests to a survivor and resume them there (on by
default with ``"reinference"``; the survivors are found on vLLM's DP store, ``survivors.py``,
or named by ``"handoff_urls": [...]`` in the ``ftengine`` options).

When only a rank's worker dies, its engine core and API server live on, but the engine core
is DEAD: nothing can run its requests there. Instead of aborting them, the engine core
(the patched ``on_fault``, busy-loop thread) takes each held request out of its scheduler
and, on a thread of its own, asks a survivor's OpenAI server for the rest:
``POST /v1/completions`` with ``prompt`` = prompt + emitted token ids, ``max_tokens`` = what
is left, greedy, ``return_token_ids``, ``stream``. Each chunk's token ids go into this
engine core's own output queue as ``EngineCoreOutputs`` for the request's id, so vLLM's own
API server streams them to the client that is still connected to it: the same detokenizer,
token offsets and ``usage`` (counting the original prompt) as without the fault, no token
missing or repeated. A survivor that is still recovering (``unhealthy`` until the
orchestrator's ``scale_down``) queues the request and serves it once it is ``healthy``.

Why here and not in the API server: the engine core already holds each request's exact
state (prompt ids, emitted ids, sampling params), and its output queue is the one path
into the API server's stream; the API server needs no change.

Exact resumption needs a deterministic continuation: only greedy requests are handed off.
A request that samples (seeded or not), asks for logprobs, or uses what depends on which
tokens are "output" (presence / frequency penalties, logit bias, allowed tokens, bad words,
structured outputs, logits processors' arguments) is aborted with the reason. Bounded by
the recovery deadline: vLLM stops this engine core (and its API server, with the clients'
connections) ``engine_recovery_timeout_sec`` after the fault, so what has not finished
``MARGIN_S`` before that is aborted with the reason; a survivor that refuses the request
(HTTP 4xx) aborts it with the survivor's message; one that fails (5xx, a broken stream) is
asked again from the tokens emitted so far, the next URL first.
Limits: when the whole rank is gone (its API server too), its clients' connections are gone
with it and nothing can resume them; a client that disconnects from this DEAD rank does not
stop its handed-off request (the engine core's busy loop, which would read the abort, waits
for a recovery), which runs to its end on the survivor. Survivors behind an API key get
this rank's (``API_KEY_ENV``, or ``VLLM_API_KEY``): the deployment's ranks share theirs.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import httpx

from ftengine.integrations.vllm.config import VllmFtSettings
from ftengine.integrations.vllm.engine_core.survivors import FixedSurvivors, SurvivorDirectory
from ftengine.integrations.vllm.messages import API_URL_ENV, deployment_api_key, import_vllm

logger = logging.getLogger(__name__)

HANDOFF_ATTR = "_ftengine_handoff"
ENGINE_MODULE = "vllm.v1.engine"
MARGIN_S = 1.0  # finish (or abort) this long before vLLM stops the engine core and server
RETRY_PAUSE_S = 0.5  # between two asks after a survivor failed
CONNECT_TIMEOUT_S = 5.0
LATE_POLL_S = 0.2  # how often the DEAD engine core's input queue is looked at
NOT_EXACT = {
    "presence_penalty": "a presence penalty",
    "frequency_penalty": "a frequency penalty",
    "logprobs": "logprobs",
    "prompt_logprobs": "prompt logprobs",
    "logit_bias": "a logit bias",
    "allowed_token_ids": "allowed token ids",
    "bad_words": "bad words",
    "structured_outputs": "structured outputs",
    "extra_args": "extra arguments (logits processors, KV transfer)",
}
"""Sampling fields (falsy = unused) a resumed request could not honour exactly: each
counts emitted tokens apart from the prompt's, or returns per-token data this engine core
would have to rebuild."""


class SurvivorRefused(Exception):
    """A survivor answered 4xx: asking again (anywhere) gets the same answer."""


class SurvivorFailed(Exception):
    """A survivor failed (5xx, connection, a stream cut short): ask again."""


@attrs.frozen
class Resume:
    """What a survivor needs to continue one request: its engine-core id and client, the
    prompt and the tokens the client already has, and its sampling fields."""

    request_id: str
    client_index: int
    prompt: tuple[int, ...]
    emitted: tuple[int, ...]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]
    repetition_penalty: float

    def body(self, emitted: Sequence[int], model: str) -> dict[str, object]:
        """The survivor's ``/v1/completions`` body once ``emitted`` tokens are out."""
        return {
            "model": model,
            "prompt": [*self.prompt, *emitted],
            "max_tokens": self.max_tokens - len(emitted),
            "min_tokens": max(0, self.min_tokens - len(emitted)),
            "temperature": 0.0,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": list(self.stop_token_ids),
            # Applied to prompt and output tokens alike: moving emitted tokens into the
            # prompt leaves it unchanged (presence / frequency penalties would not be).
            "repetition_penalty": self.repetition_penalty,
            "stream": True,
            "return_token_ids": True,
        }


def refusal(request: Any) -> str | None:
    """Why ``request`` (``vllm.v1.request.Request``) cannot resume exactly on a survivor, or
    None when it can."""
    params = request.sampling_params
    if params is None or request.prompt_token_ids is None:
        return "it has no sampling params or no prompt token ids (pooling, prompt embeds)"
    if getattr(request, "mm_features", None) or getattr(request, "lora_request", None):
        return "it carries multimodal inputs or a LoRA adapter"
    if params.temperature >= 1e-5:  # vLLM's _SAMPLING_EPS: below it, sampling is greedy
        seeded = "" if params.seed is None else f" with seed {params.seed}"
        return (
            f"it samples at temperature {params.temperature:g}{seeded}; only greedy requests "
            "resume exactly"
        )
    used = [what for name, what in NOT_EXACT.items() if getattr(params, name, None)]
    if used:
        return f"it uses {', '.join(used)}, which a resumed request cannot honour exactly"
    return None


def resume_state(request: Any) -> Resume:
    """The :class:`Resume` of a request :func:`refusal` accepted."""
    params = request.sampling_params
    return Resume(
        request_id=request.request_id,
        client_index=int(request.client_index),
        prompt=tuple(request.prompt_token_ids),
        emitted=tuple(request.output_token_ids),
        max_tokens=int(request.max_tokens),
        min_tokens=int(params.min_tokens),
        ignore_eos=bool(params.ignore_eos),
        stop_token_ids=tuple(params.stop_token_ids or ()),
        repetition_penalty=float(params.repetition_penalty),
    )


def emit(
    engine: Any,
    state: Resume | Any,
    tokens: Sequence[int],
    finish: str | None = None,
    stop_reason: object = None,
) -> None:
    """Put ``tokens`` (and, when ``finish`` is vLLM's finish-reason name, the end) of the
    request ``state`` (a :class:`Resume`, or vLLM's ``Request``: both have ``request_id``
    and ``client_index``) into the engine core's output queue, as its own steps would."""
    v1 = import_vllm(ENGINE_MODULE)
    reason = None if finish is None else getattr(v1.FinishReason, finish.upper(), None)
    if finish is not None and reason is None:  # a finish reason this vLLM does not know
        reason, stop_reason = v1.FinishReason.ABORT, f"survivor finished with {finish!r}"
    output = v1.EngineCoreOutput(
        request_id=state.request_id,
        new_token_ids=list(tokens),
        finish_reason=reason,
        stop_reason=stop_reason,
    )
    done = None if reason is None else {state.request_id}
    engine.output_queue.put_nowait(
        (state.client_index, v1.EngineCoreOutputs(outputs=[output], finished_requests=done))
    )


def stream_chunks(
    client: httpx.Client,
    url: str,
    body: Mapping[str, object],
    read_s: float,
    headers: Mapping[str, str] | None = None,
) -> Iterator[tuple[list[int], str | None, object]]:
    """``(token ids, finish reason, stop reason)`` of each choice a survivor's streamed
    completion sends; :class:`SurvivorRefused` on a 4xx, :class:`SurvivorFailed` on a 5xx,
    an error event or a stream that ends before its finish reason."""
    timeout = httpx.Timeout(read_s, connect=min(CONNECT_TIMEOUT_S, read_s))
    with client.stream(
        "POST", f"{url}/v1/completions", json=body, timeout=timeout, headers=dict(headers or {})
    ) as reply:
        if reply.status_code != 200:
            text = reply.read().decode(errors="replace")[:500]
            error = SurvivorRefused if 400 <= reply.status_code < 500 else SurvivorFailed
            raise error(f"{url} answered {reply.status_code}: {text}")
        for line in reply.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data:") :])
            if "error" in event:
                raise SurvivorFailed(f"{url} streamed an error: {event['error']}")
            for choice in event.get("choices", ()):
                finish = choice.get("finish_reason")
                yield list(choice.get("token_ids") or ()), finish, choice.get("stop_reason")
                if finish is not None:
                    return
    raise SurvivorFailed(f"{url}'s stream ended before its finish_reason")


@attrs.define
class Handoff:
    """One engine core's survivors (``survivors()``: base URLs, tried in turn), the model
    name they serve, and how long a handoff may take from the fault (the recovery
    deadline)."""

    survivors: Callable[[], tuple[str, ...]]
    model: str
    deadline_s: float
    threads: list[threading.Thread] = attrs.field(factory=list)  # one per handed-off request
    api_key: str | None = None  # sent to the survivors' servers as a bearer token
    late: threading.Thread | None = None  # :meth:`late_arrivals`, from the fault on
    stopped: threading.Event = attrs.field(factory=threading.Event)  # ends ``late`` (tests)

    def take(self, engine: Any, requests: Sequence[Any], dead_reason: str) -> dict[str, list[Any]]:
        """On the DEAD engine's fault (busy-loop thread): take what can resume exactly out
        of the scheduler (no abort sent) and resume each on a survivor on its own thread.
        Returns the rest, by the reason the caller aborts them with."""
        refused: dict[str, list[Any]] = {}
        states = []
        for request in requests:
            why = refusal(request)
            if why is None:
                states.append(resume_state(request))
            else:
                reason = f"{dead_reason}; not handed to a survivor: {why}"
                refused.setdefault(reason, []).append(request)
        status = import_vllm("vllm.v1.request").RequestStatus
        engine.scheduler.finish_requests([s.request_id for s in states], status.FINISHED_ABORTED)
        deadline = time.monotonic() + self.deadline_s - MARGIN_S
        for state in states:
            self._start(engine, state, deadline, dead_reason)
        if states:
            logger.warning("[FT] handing %d held requests to a survivor", len(states))
        self.late = threading.Thread(
            target=self.late_arrivals, args=(engine, deadline, dead_reason), daemon=True,
            name="ftengine-handoff-late",
        )  # fmt: skip
        self.late.start()
        return refused

    def _start(self, engine: Any, state: Resume, deadline: float, dead_reason: str) -> None:
        thread = threading.Thread(
            target=self.resume, args=(engine, state, deadline, dead_reason), daemon=True,
            name=f"ftengine-handoff-{state.request_id}",
        )  # fmt: skip
        self.threads.append(thread)
        thread.start()

    def late_arrivals(self, engine: Any, deadline: float, dead_reason: str) -> None:
        """Requests that reach this DEAD engine core after its fault (sent before its API
        server learned it is DEAD, which then refuses new ones: ``api_server/dead_rank.py``)
        wait in its input queue, which nothing reads any more: until ``deadline`` (or
        ``stopped``), each is handed off as a held one is, or aborted saying why. Everything
        else there (aborts, utility calls) goes back, in order, for a busy loop that will
        not run again."""

        def arrived(request: Any) -> None:
            why = refusal(request)
            if why is None:
                logger.warning("[FT] request %s reached DEAD engine core: handing it off",
                               request.request_id)  # fmt: skip
                self._start(engine, resume_state(request), deadline, dead_reason)
            else:
                reason = f"{dead_reason}; not handed to a survivor: {why}"
                emit(engine, request, [], "abort", reason)

        drain_added(engine, arrived, deadline, self.stopped, LATE_POLL_S)

    def resume(self, engine: Any, state: Resume, deadline: float, dead_reason: str) -> None:
        """Ask survivors in turn until the request ends or ``deadline`` (``time.monotonic``)
        passes; tokens go to the client as they come, an abort says why (with no survivor
        to ask: ``dead_reason`` and why none)."""
        emitted = list(state.emitted)
        started, problem, attempt = time.monotonic(), "no survivor was asked", 0
        urls, missing = self._urls()
        if not urls:
            reason = f"{dead_reason}; not handed to a survivor: {missing}"
            emit(engine, state, [], "abort", reason)
            logger.warning("[FT] request %s: %s", state.request_id, reason)
            return
        with httpx.Client() as client:
            while (left := deadline - time.monotonic()) > 0:
                url = urls[attempt % len(urls)]
                attempt += 1
                try:
                    if self._attempt(client, engine, state, emitted, url, left):
                        logger.info(
                            "[FT] request %s resumed on %s: %d tokens in %.2fs",
                            state.request_id, url, len(emitted) - len(state.emitted),
                            time.monotonic() - started,
                        )  # fmt: skip
                        return
                except SurvivorRefused as exc:
                    emit(engine, state, [], "abort", f"handoff to a survivor refused: {exc}")
                    return
                except (SurvivorFailed, httpx.HTTPError, ValueError) as exc:
                    problem = f"{url}: {type(exc).__name__}: {exc}"
                    time.sleep(max(0.0, min(RETRY_PAUSE_S, deadline - time.monotonic())))
        reason = (
            f"handed to a survivor, but it did not finish within the {self.deadline_s:g}s "
            f"recovery deadline ({len(emitted)} tokens out; last problem: {problem})"
        )
        emit(engine, state, [], "abort", reason)
        logger.warning("[FT] request %s: %s", state.request_id, reason)

    def _urls(self) -> tuple[tuple[str, ...], str]:
        """The survivors to ask, and why there are none when there are none."""
        try:
            urls = self.survivors()
        except (RuntimeError, OSError, ValueError) as exc:  # the DP store (torch's
            # DistStoreError is a RuntimeError), hosted by DP rank 0, did not answer
            return (), f"the survivors could not be looked up: {type(exc).__name__}: {exc}"
        return urls, "no other rank's API server is known (none published one on the DP store)"

    def _attempt(
        self,
        client: httpx.Client,
        engine: Any,
        state: Resume,
        emitted: list[int],
        url: str,
        left_s: float,
    ) -> bool:
        """One ask of ``url``; True once the request has ended (``emitted`` grows with each
        token forwarded, so a failed ask resumes from there)."""
        if len(emitted) >= state.max_tokens:
            emit(engine, state, [], "length")
            return True
        body = state.body(emitted, self.model)
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        for tokens, finish, stop_reason in stream_chunks(client, url, body, left_s, auth):
            emitted.extend(tokens)
            if tokens or finish is not None:
                emit(engine, state, tokens, finish, stop_reason)
            if finish is not None:
                return True
        return False


def served_model(vllm_config: Any) -> str:
    """The model name the survivors' servers answer to (the same deployment's)."""
    model = vllm_config.model_config
    names = model.served_model_name
    if isinstance(names, list | tuple):
        names = names[0] if names else None
    return str(names or model.model)


def install(
    sentinel: Any,
    settings: VllmFtSettings,
    last_read: Callable[[], Mapping[int, str]] | None = None,
) -> None:
    """Give the ``EngineCoreSentinel`` its :class:`Handoff` (re-inference is on): to the
    ``handoff_urls`` when set, else to the survivors found on the DP store, whose own URL
    this engine core publishes there now (and on each new store: :func:`publish_url`), or,
    once that store is gone, to those ``last_read`` gives (the agent's DP board). A
    deployment of one rank has no survivor: nothing is installed."""
    engine = sentinel.engine
    parallel = engine.vllm_config.parallel_config
    survivors: Callable[[], tuple[str, ...]]
    if settings.handoff_urls:
        survivors = FixedSurvivors(settings.handoff_urls)
    elif int(parallel.data_parallel_size) > 1:
        own = os.environ.get(API_URL_ENV) or None
        rank, world = int(parallel.data_parallel_rank), int(parallel.data_parallel_size)
        survivors = SurvivorDirectory(engine, rank, world, own, last_read=last_read)
    else:
        return
    model = served_model(engine.vllm_config)
    handoff = Handoff(survivors, model, settings.recovery_timeout_s, api_key=deployment_api_key())
    setattr(sentinel, HANDOFF_ATTR, handoff)
    publish_url(sentinel)


def publish_url(sentinel: Any) -> None:
    """This engine core's API server URL on its current DP store, for its peers' handoffs
    (``survivors.py``); no I/O unless the store is new. A store that fails is logged: the
    status push that calls this must go on."""
    handoff: Handoff | None = getattr(sentinel, HANDOFF_ATTR, None)
    directory = None if handoff is None else handoff.survivors
    if isinstance(directory, SurvivorDirectory):
        try:
            directory.publish()
        except Exception:
            logger.warning(
                "[FT] engine %s could not publish its API server's URL on the DP store",
                directory.rank, exc_info=True,
            )  # fmt: skip


def release_dead(
    sentinel: Any, engine: Any, requests: Sequence[Any], reason: str
) -> dict[str, list[Any]] | None:
    """A DEAD engine's held ``requests``: None when this engine core has no
    :class:`Handoff` (re-inference off, or a single rank: the caller aborts them all); else
    they are handed to survivors and what could not be is returned, by abort reason (see
    :meth:`Handoff.take`)."""
    handoff: Handoff | None = getattr(sentinel, HANDOFF_ATTR, None)
    if handoff is None:
        return None
    return handoff.take(engine, requests, reason)


def drain_added(
    engine: Any,
    arrived: Callable[[Any], None],
    until: float,
    stopped: threading.Event,
    poll_s: float,
) -> int:
    """Until ``until`` (``time.monotonic``) or ``stopped``: take every request added to
    ``engine``'s input queue (vLLM's ``Request``, preprocessed already) and pass it to
    ``arrived``; put everything else there (aborts, utility calls) back, in order, at the
    end. How many requests were taken."""
    add = import_vllm(ENGINE_MODULE).EngineCoreRequestType.ADD
    kept: list[Any] = []
    taken = 0
    while not stopped.is_set() and time.monotonic() < until:
        try:
            item = engine.input_queue.get(timeout=poll_s)
        except queue.Empty:
            continue
        request_type, payload = item
        if request_type != add:
            kept.append(item)
            continue
        arrived(payload[0])  # (vllm.v1.request.Request, wave)
        taken += 1
    for item in kept:
        engine.input_queue.put_nowait(item)
    return taken
