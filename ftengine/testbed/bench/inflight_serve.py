"""A real ``ftengine serve`` for the in-flight benchmark: a subprocess on loopback and an
ephemeral port, driven through HTTP only (status, commands, completions) and stopped with
SIGTERM by its pid; only the processes it started are ever signalled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

from ftengine.errors import FTEngineError

START_TIMEOUT_S = 180.0
COMMAND_TIMEOUT_S = 120.0
STATUS = "/fault_tolerance/status"
APPLY = "/fault_tolerance/apply"
REQUESTS = "/fault_tolerance/requests"
MODEL = "ftengine-bench"

Engines = dict[int, dict[str, Any]]


class ServeError(FTEngineError, RuntimeError):
    """The server did not start, answer or carry out a command as expected."""


class Server:
    """One ``ftengine serve`` subprocess (``args``: its flags beyond port, checkpoint and
    model name) and the processes it started; the log goes to ``home/serve.log``."""

    def __init__(self, home: Path, checkpoint: Path, args: Sequence[str]) -> None:
        home.mkdir(parents=True, exist_ok=True)
        port_file = home / "port"
        command = [sys.executable, "-m", "ftengine", "serve", "--port", "0"]
        command += ["--port-file", str(port_file), "--checkpoint", str(checkpoint)]
        command += ["--served-model-name", MODEL, "--log-level", "warning", *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FTENGINE_")}
        self.log_path = home / "serve.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ServeError(f"expected ftengine serve to start; log: {self.logs()}")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"
        self.http = httpx.Client(base_url=self.url, timeout=60.0)
        self.descendants = {p.pid for p in psutil.Process(self.process.pid).children(True)}

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def engines(self) -> Engines:
        status = self.http.get(STATUS)
        if status.status_code != 200:
            raise ServeError(f"expected 200 from {STATUS}, got {status.status_code}")
        return {engine["id"]: engine for engine in status.json()["engines"]}

    def wait(self, predicate: Callable[[Engines], bool], timeout_s: float) -> float:
        """Poll the status until ``predicate`` holds; the ``time.monotonic`` it first held."""
        deadline = time.monotonic() + timeout_s
        while not predicate(engines := self.engines()):
            if time.monotonic() > deadline:
                raise ServeError(f"status never reached the expected state; found {engines}")
            time.sleep(0.02)
        return time.monotonic()

    def command(self, instruction: str, params: dict[str, Any], request_id: str) -> None:
        """``POST /fault_tolerance/apply`` and wait for its result, which must succeed."""
        body = {"instruction": instruction, "params": params, "request_id": request_id}
        accepted = self.http.post(APPLY, json=body)
        if accepted.status_code != 202:
            raise ServeError(f"expected 202 for {instruction}, got {accepted.text}")
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while (record := self.http.get(f"{REQUESTS}/{request_id}").json())["state"] != "done":
            if time.monotonic() > deadline:
                raise ServeError(f"command {request_id} ({instruction}) never finished")
            time.sleep(0.05)
        if record["result"]["success"] is not True:
            raise ServeError(f"expected {instruction} to succeed, got {record['result']}")

    def pid_of(self, rank: int) -> int:
        """The pid of rank ``rank``'s worker, which must be one this server started."""
        pid = int(self.engines()[rank]["pid"])
        if pid not in self.descendants:
            raise ServeError(f"expected rank {rank}'s pid {pid} among the server's processes")
        return pid

    def stop(self) -> None:
        """SIGTERM by pid, SIGKILL after 30 s; then its leftover children, by pid."""
        if hasattr(self, "http"):
            self.http.close()
        stop_process_tree(self.process, getattr(self, "descendants", set()))


def stop_process_tree(process: subprocess.Popen[bytes], descendants: set[int]) -> list[int]:
    """Stop ``process`` (SIGTERM, SIGKILL after 30 s), give ``descendants`` (pids it
    started) 15 s to exit on their own, SIGKILL those left; return the pids it killed."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    # Helpers of the server (multiprocessing's resource tracker) exit on their own once
    # the server is gone, a moment later under load: a bounded grace period.
    deadline = time.monotonic() + 15.0
    while (left := _running(descendants)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:  # only ever this server's own children
        os.kill(pid, signal.SIGKILL)
    return left


def _running(pids: set[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive
