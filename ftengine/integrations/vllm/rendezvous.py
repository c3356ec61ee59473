"""The rendezvous of a stateless gloo group that a recovery rebuilds (vLLM's
``stateless_init_torch_distributed_process_group``), without torch's connect back-off.

The group's dense rank 0 makes the rendezvous TCPStore; a member whose client tries to
connect before that store listens is refused and backs off (torch's jittered back-off:
0.3-0.7 s measured here for a store that came 10-200 ms late), and the store's maker waits
for it in turn. Every member but rank 0 therefore first waits, polling every ``POLL_S``,
until the store accepts a connection: the group forms as soon as its last member comes."""

from __future__ import annotations

import socket
import time
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
