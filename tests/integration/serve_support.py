"""A real ``ftengine serve`` for the HTTP tests: a subprocess on loopback and an ephemeral
port, driven through HTTP only, stopped with SIGTERM by pid; every process it started must
be gone afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from ftengine.testbed.bench.inflight_serve import stop_process_tree

SIZES: dict[str, Any] = {"layers": 2, "experts": 8, "hidden": 64, "intermediate": 32}
SIZE_FLAGS = ["--layers", "2", "--experts", "8", "--hidden", "64", "--intermediate", "32"]
START_TIMEOUT_S = 120.0
STATUS = "/fault_tolerance/status"
APPLY = "/fault_tolerance/apply"
REQUESTS = "/fault_tolerance/requests"
MODEL = "ftengine-test"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without ftengine's own variables, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("FTENGINE_API_KEY", "FTENGINE_INJECT_FAULT")
    }
    return {**env, **extra}


class Server:
    """One ``ftengine serve`` subprocess and the processes it started."""

    def __init__(self, tmp: Path, checkpoint: Path, *extra: str, env: dict[str, str]) -> None:
        port_file = tmp / "port"
        command = [sys.executable, "-m", "ftengine", "serve", "--port", "0"]
        command += ["--port-file", str(port_file), "--checkpoint", str(checkpoint), *SIZE_FLAGS]
        command += ["--op-timeout", "2", "--log-level", "warning"]
        command += ["--served-model-name", MODEL, *extra]
        self.log = (tmp / "serve.log").open("wb")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            assert self.process.poll() is None, f"serve exited early: {self.logs()}"
            assert time.monotonic() < deadline, f"serve not ready in time: {self.logs()}"
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        self.http = httpx.Client(base_url=self.url, timeout=60.0)
        self.descendants = {p.pid for p in psutil.Process(self.process.pid).children(True)}

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def engines(self) -> dict[int, dict[str, Any]]:
        status = self.http.get(STATUS)
        assert status.status_code == 200, status.text
        return {engine["id"]: engine for engine in status.json()["engines"]}

    def wait(self, predicate: Callable[[dict[int, dict[str, Any]]], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(engines := self.engines()):
            assert time.monotonic() < deadline, f"timed out; engines: {engines}"
            time.sleep(0.05)

    def result(self, request_id: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + 90
        while True:
            record = self.http.get(f"{REQUESTS}/{request_id}", headers=headers)
            assert record.status_code == 200, record.text
            if record.json()["state"] == "done":
                return dict(record.json()["result"])
            assert time.monotonic() < deadline, f"command {request_id} never finished"
            time.sleep(0.05)

    def metrics(self) -> Samples:
        text = self.http.get("/metrics").text
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def stop(self) -> None:
        """SIGTERM by pid; every process the server started must be gone afterwards."""
        self.http.close()
        leftovers = stop_process_tree(self.process, self.descendants)
        self.log.close()
        assert not leftovers, f"serve left processes behind: {leftovers}"


def metric(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


class Starter:
    """Starts servers on one checkpoint, each in its own folder; stops them all at the end."""

    def __init__(self, tmp: Path, checkpoint: Path) -> None:
        self.tmp = tmp
        self.checkpoint = checkpoint
        self.servers: list[Server] = []

    def __call__(self, *extra: str, **env: str) -> Server:
        home = self.tmp / f"server-{len(self.servers)}"
        home.mkdir()
        server = Server(home, self.checkpoint, *extra, env=clean_env(**env))
        self.servers.append(server)
        return server

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()
