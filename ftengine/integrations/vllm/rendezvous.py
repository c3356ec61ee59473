"""The rendezvous of a stateless gloo group that a recovery rebuilds (vLLM's
``stateless_init_torch_distributed_process_group``), without torch's connect back-off.

The group's dense rank 0 makes the rendezvous TCPStore; a member whose client tries to
connect before that store listens is refused and backs off (torch's jittered back-off:
0.3-0.7 s measured here for a store that came 10-200 ms late), and the store's maker waits
for it in turn. Every member but rank 0 therefore first waits, polling every ``POLL_S``,
until the store accepts a connection: the group forms as soon as its last member comes.

The store is where the group's dense rank 0 runs, which is not always DP rank 0's host:
:func:`store_host` names the address that rank publishes for its members."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta

POLL_S = 0.005
CONNECT_S = 0.5  # one probe's connect (a listening store on the LAN answers far sooner)
DEFAULT_WAIT_S = 30.0


def await_store(host: str, port: int, timeout: timedelta | None) -> bool:
    """Wait until a TCP server listens on ``host:port`` (at most ``timeout``, the group's
    own; None: ``DEFAULT_WAIT_S``); True if it did. After the wait torch's own connect runs
    as before (and reports a store that never came with its own error)."""
    wait_s = DEFAULT_WAIT_S if timeout is None else timeout.total_seconds()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection((host, port), timeout=CONNECT_S).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)


def store_host(master_ip: str, dp_rank: int, host_ip: Callable[[], str]) -> str:
    """The address at which the members reach a group whose stores DP rank ``dp_rank``
    hosts: vLLM's ``data_parallel_master_ip`` for rank 0 (the operator's address of its
    host) or on one host (a loopback master: every rank is local); otherwise this host's
    own, ``host_ip()`` (vLLM's ``get_ip``: ``VLLM_HOST_IP`` when set, else the interface of
    the default route). Rank 0's address would send them to another host, where no store of
    theirs listens."""
    if dp_rank == 0 or _loopback(master_ip):
        return master_ip
    return host_ip()


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
