"""How the supervisor starts its worker processes: ``spawn`` (a fresh interpreter per
worker, which imports torch and ftengine anew: seconds of CPU each, the most of a launch on
a small model) or ``forkserver`` (each worker forked from one server process that imported
them once, when the supervisor's process first started a worker; what a campaign that
rebuilds its cluster many times wants). Either way a worker runs ``worker_main`` with the
supervisor's environment of the moment and dies with its parent."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext

from ftengine.testbed.cluster.worker import WorkerSpec, worker_main

FORKSERVER_PRELOAD = ["ftengine.testbed.cluster.worker"]
"""What the fork server imports before its first fork (torch, the model, the backend)."""


def worker_context(method: str) -> BaseContext:
    """The multiprocessing context that starts workers by ``method`` (one of
    ``ftengine.testbed.cluster.config.WORKER_STARTS``)."""
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        # Read when the fork server starts (once per process); ignored after.
        context.set_forkserver_preload(FORKSERVER_PRELOAD)
    return context


def worker_target(
    method: str, spec: WorkerSpec, conn: Connection
) -> tuple[Callable[..., None], tuple[object, ...]]:
    """The ``Process`` target and args that run rank ``spec.rank``'s worker on ``conn``."""
    if method == "forkserver":
        return forked_worker_main, (dict(os.environ), spec, conn)
    return worker_main, (spec, conn)


def forked_worker_main(environ: Mapping[str, str], spec: WorkerSpec, conn: Connection) -> None:
    """``worker_main`` under the supervisor's environment at start: a forked worker would
    otherwise inherit the fork server's, frozen when that server started (a variable set
    since, such as ``FTENGINE_WORKER_LOG``, would be missing). Variables torch read at
    import keep the fork server's values."""
    os.environ.clear()
    os.environ.update(environ)
    worker_main(spec, conn)
