"""One generation of the campaign's deployment: a CPU cluster, its serving loop and the
control + OpenAI HTTP API (the same app ``ftengine serve`` runs) on an ephemeral loopback
port, all in this process, so the campaign can signal exactly the cluster's own workers."""

from __future__ import annotations

import socket
import threading
import time

import psutil
import uvicorn

from ftengine.testbed.cluster import Cluster, ClusterConfig
from ftengine.testbed.cluster.serving import ServingLoop
from ftengine.testbed.control.app import create_app
from ftengine.testbed.control.openai_routes import Completions
from ftengine.testbed.control.served_model import ServedModel

MODEL_NAME = "chaos"


class Deployment:
    """A cluster served over HTTP; build it with :meth:`launch`, end it with :meth:`close`."""

    def __init__(self, cluster: Cluster, serving: ServingLoop, sock: socket.socket) -> None:
        self.cluster = cluster
        self.serving = serving
        self._sock = sock
        app = create_app(
            cluster,
            completions=Completions(
                serving, ServedModel.from_checkpoint(cluster.config.checkpoint, MODEL_NAME)
            ),
        )
        self._stop_observer = app.state.plane.observe_every(0.25)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="chaos-http", daemon=True
        )
        self._thread.start()
        self.port: int = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker_pids = {r: p for r, p in cluster.pids().items() if p is not None}

    @classmethod
    def launch(cls, config: ClusterConfig) -> Deployment:
        """Launch the cluster, start serving, bind and serve HTTP; wait until it answers."""
        cluster = Cluster.launch(config)
        serving = ServingLoop(cluster, resumption=cluster.resumption()).start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        deployment = cls(cluster, serving, sock)
        deadline = time.monotonic() + 30.0
        while not deployment._server.started:
            if time.monotonic() > deadline:
                deployment.close()
                raise RuntimeError("the chaos deployment's HTTP server did not start in 30 s")
            time.sleep(0.02)
        return deployment

    def rss(self) -> dict[int, int]:
        """Resident bytes of every live worker, by rank."""
        sizes = {}
        for rank, pid in self.worker_pids.items():
            if rank in self.cluster.live_ranks():
                try:
                    sizes[rank] = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    continue
        return sizes

    def close(self) -> None:
        """Stop HTTP, the serving loop and the cluster (every worker it started)."""
        self._server.should_exit = True
        self._thread.join(timeout=10.0)
        self._stop_observer()
        self.serving.close()
        self.cluster.shutdown()
        self._sock.close()
