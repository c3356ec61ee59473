"""DP rank 0's API server keeps answering the start-up handshake after start-up (issue 28).

In vLLM's external-LB mode every engine core first handshakes with DP rank 0's front end at
``tcp://<data-parallel-address>:<data-parallel-rpc-port>`` (a ZMQ ROUTER bound inside
``launch_core_engines``): HELLO, then vLLM's init message (the DP coordinator's addresses
and the DP master ports), then READY with ``parallel_config.compute_hash()``. vLLM closes
that socket once every engine is READY (``wait_for_engine_startup`` returns), so a removed
rank restarted with its original command waits ``HANDSHAKE_TIMEOUT_MINS`` (5) for a HELLO
answer and exits (measured: docs/design-vllm-rejoin.md).

:func:`answering_rejoins` wraps ``wait_for_engine_startup``: once it returns, a
:class:`RejoinResponder` thread binds the same address again and answers any known DP
rank's HELLO with the same init message plus ``rejoin_flag.REJOIN_KEY``,
which tells the restarted engine core (and its worker) that it rejoins: it then starts
alone (``engine_core/rejoin.py``) rather than in the original DP groups. Its READY is checked
against this server's ``compute_hash()`` as vLLM checks it; a mismatch is logged (the rank
must not be admitted). Only with ``--enable-fault-tolerance``, DP > 1, on DP rank 0's
server, for a TCP handshake address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ftengine.integrations.vllm.messages import API_URL_ENV, import_vllm
from ftengine.integrations.vllm.rejoin_flag import RANK0_URL_KEY, REJOIN_KEY

logger = logging.getLogger(__name__)

UTILS_MODULE = "vllm.v1.engine.utils"
INIT_KEYS = (
    "data_parallel_master_ip",
    "data_parallel_master_port",
    "_data_parallel_master_port_list",
    "_coord_store_port",
    "data_parallel_size",
)
"""The ``ParallelConfig`` fields vLLM's ``wait_for_engine_startup`` sends in its init message."""
BIND_WAIT_S = 30.0  # vLLM's socket closes as its context exits, right after the wait returns
POLL_MS = 200


def init_message(addresses: Any, parallel_config: Any) -> bytes:
    """vLLM's ``EngineHandshakeMetadata`` for a rejoining engine: the start-up's addresses
    and DP fields, plus :data:`REJOIN_KEY` and, when this server has a URL
    (``API_URL_ENV``), :data:`RANK0_URL_KEY`."""
    utils = import_vllm(UTILS_MODULE)
    fields: dict[str, Any] = {k: getattr(parallel_config, k) for k in INIT_KEYS}
    fields[REJOIN_KEY] = 1
    url = os.environ.get(API_URL_ENV)
    if url:
        fields[RANK0_URL_KEY] = url
    metadata = utils.EngineHandshakeMetadata(addresses=addresses, parallel_config=fields)
    return bytes(import_vllm("msgspec").msgpack.encode(metadata))


class RejoinResponder:
    """Answers restarted engines' handshakes at ``endpoint`` (a thread; :meth:`stop`)."""

    def __init__(
        self,
        endpoint: str,
        identities: Iterable[bytes],
        message: bytes,
        expected_hash: str | None,
    ) -> None:
        self.endpoint = endpoint
        self.identities = frozenset(identities)
        self.message = message
        self.expected_hash = expected_hash
        self.answered: list[int] = []  # DP ranks whose HELLO got the init message
        self.ready: dict[int, bool] = {}  # DP rank -> its READY's hash matched
        self.bound = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="ftengine-rejoin-responder", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        zmq = import_vllm("zmq")
        ctx = zmq.Context()
        try:
            socket = self._bind(ctx, zmq)
            if socket is None:
                return
            with contextlib.closing(socket):
                self.bound.set()
                logger.info(
                    "[FT] Answering restarted DP ranks' start-up handshakes at %s", self.endpoint
                )
                while not self._stop.is_set():
                    if socket.poll(POLL_MS):
                        identity, raw = socket.recv_multipart()
                        self._answer(socket, identity, raw)
        except Exception:  # never take the API server down; say why it stopped
            logger.exception("[FT] The rejoin handshake responder at %s stopped", self.endpoint)
        finally:
            ctx.destroy(linger=0)

    def _bind(self, ctx: Any, zmq: Any) -> Any:
        deadline = time.monotonic() + BIND_WAIT_S
        while not self._stop.is_set():
            socket = ctx.socket(zmq.ROUTER)
            socket.setsockopt(zmq.LINGER, 0)
            try:
                socket.bind(self.endpoint)
                return socket
            except zmq.ZMQError as exc:
                socket.close()
                if time.monotonic() > deadline:
                    logger.error(
                        "[FT] Cannot bind %s to answer restarted DP ranks' handshakes: %s; a "
                        "removed rank restarted later cannot rejoin", self.endpoint, exc,
                    )  # fmt: skip
                    return None
                time.sleep(0.1)
        return None

    def _answer(self, socket: Any, identity: bytes, raw: bytes) -> None:
        rank = int.from_bytes(identity, "little")
        if identity not in self.identities:
            logger.warning("[FT] Handshake from unknown DP rank %d ignored", rank)
            return
        msg = import_vllm("msgspec").msgpack.decode(raw)
        status = msg.get("status") if isinstance(msg, dict) else None
        if status == "HELLO":
            self.answered.append(rank)  # before the answer: its receiver may look at once
            socket.send_multipart((identity, self.message))
            logger.info("[FT] DP rank %d restarted: answered its start-up handshake (rejoin)", rank)
        elif status == "READY":
            found = msg.get("parallel_config_hash")
            ok = self.expected_hash is None or found == self.expected_hash
            self.ready[rank] = ok
            if ok:
                logger.info("[FT] Restarted DP rank %d finished its start-up handshake", rank)
            else:
                logger.error(
                    "[FT] Restarted DP rank %d has another parallel configuration (hash %s, "
                    "expected %s): it must not be admitted; restart it with the original "
                    "command", rank, found, self.expected_hash,
                )  # fmt: skip
        else:
            logger.warning("[FT] Unexpected handshake message from DP rank %d: %r", rank, msg)


def serves_rejoins(parallel_config: Any, endpoint: str) -> bool:
    """Whether this front end answers rejoins: fault tolerance on, DP > 1, DP rank 0's
    server (it holds the handshake every rank dials), a TCP address (remote ranks)."""
    return (
        bool(getattr(parallel_config, "enable_fault_tolerance", False))
        and int(parallel_config.data_parallel_size) > 1
        and int(parallel_config.data_parallel_rank) == 0
        and endpoint.startswith("tcp://")
    )


RESPONDERS: list[RejoinResponder] = []
"""The responders this process started (one per deployment; tests stop them)."""


def answering_rejoins(wait: Callable[..., None]) -> Callable[..., None]:
    """``wait_for_engine_startup`` that starts a :class:`RejoinResponder` once it returned."""

    def wait_for_engine_startup(
        handshake_socket: Any,
        core_engines: Any,
        parallel_config: Any,
        coordinated_dp: Any,
        cache_config: Any,
        launch: Any,
    ) -> None:
        zmq = import_vllm("zmq")
        endpoint = handshake_socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        wait(handshake_socket, core_engines, parallel_config, coordinated_dp, cache_config, launch)
        if not serves_rejoins(parallel_config, endpoint):
            return
        responder = RejoinResponder(
            endpoint,
            [engine.identity for engine in core_engines],
            init_message(launch.addresses, parallel_config),
            parallel_config.compute_hash() if coordinated_dp else None,
        )
        RESPONDERS.append(responder)
        responder.start()

    return wait_for_engine_startup
