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

POLL_S = 0.005


def await_store(host: str, port: int, timeout_s: float | None) -> bool:
    """Wait until a TCP server listens on ``host:port`` (at most ``timeout_s``; None: 30 s);
    True if it did. After the wait torch's own connect runs as before (and reports a store
    that never came with its own error)."""
    deadline = time.monotonic() + (30.0 if timeout_s is None else timeout_s)
    while True:
        try:
            socket.create_connection((host, port), timeout=max(POLL_S, 0.5)).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
