"""A fault-tolerance orchestrator for any vLLM-compatible deployment, standard library only.

It speaks vLLM's REST API (``/fault_tolerance/apply``, ``/fault_tolerance/status``, OpenAI
``/v1/completions``) and drives the two scenarios of the vLLM-Ascend fault-tolerance PR:

1. an injected fault: every engine UNHEALTHY, none dead -> ``retry`` on every server;
2. a killed rank: the victim DEAD -> a ``retry`` to the victim is rejected -> ``scale_down``
   with ``removed_dp_ranks`` on every survivor's server.

    python examples/ft_orchestrator.py --server http://127.0.0.1:8000 [--server ...]

Give one ``--server`` per API server: vLLM's external load balancing runs one per DP rank,
``ftengine serve`` one for all its engines. The orchestrator probes every server with a
greedy completion, watches the status (probing on: an idle vLLM survivor only notices a dead
peer when a request comes), recovers as above, then checks that every surviving server
gives the same greedy answer as before the fault. It prints a JSON report and exits 0 when
all of that held (and the scenario is the one ``--expect`` names), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

APPLY, STATUS = "/fault_tolerance/apply", "/fault_tolerance/status"


class Api:
    """JSON over HTTP to the deployment's servers (bearer key when given)."""

    def __init__(self, api_key: str | None, timeout: float) -> None:
        self.api_key = api_key
        self.timeout = timeout

    def call(self, url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        """(HTTP status, decoded JSON body); status 0 when the server cannot be reached."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
        request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                return answer.status, json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as error:
            text = error.read()
            try:
                return error.code, json.loads(text)
            except ValueError:
                return error.code, text.decode(errors="replace")
        except (urllib.error.URLError, OSError) as error:
            return 0, str(error)


class Deployment:
    """The servers of one deployment and the engines each one reports."""

    def __init__(self, api: Api, servers: list[str], prompt: list[int], max_tokens: int) -> None:
        self.api = api
        self.servers = [server.rstrip("/") for server in servers]
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.models: dict[str, str] = {}

    def engines(self) -> dict[str, list[dict[str, Any]]]:
        """Every reachable server's engines (vLLM's status entries)."""
        found = {}
        for server in self.servers:
            code, body = self.api.call(server + STATUS)
            if code == 200:
                found[server] = list(body["engines"])
        return found

    def probe(self, server: str) -> list[int] | str | None:
        """A greedy completion's token ids (or its text, where ids are not returned);
        None when it did not complete normally (refused, aborted, unreachable)."""
        if server not in self.models:
            code, body = self.api.call(server + "/v1/models")
            if code != 200:
                return None
            self.models[server] = body["data"][0]["id"]
        request = {
            "model": self.models[server],
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        code, body = self.api.call(server + "/v1/completions", request)
        if code != 200 or body["choices"][0]["finish_reason"] not in ("length", "stop"):
            return None
        choice = body["choices"][0]
        ids = choice.get("token_ids")
        return [int(token) for token in ids] if ids else str(choice["text"])

    def probe_all(self) -> dict[str, list[int] | str | None]:
        """One probe per server, all at once (a vLLM rank's request needs its peers)."""
        answers: dict[str, list[int] | str | None] = {}

        def one(server: str) -> None:
            answers[server] = self.probe(server)

        _together(one, self.servers)
        return answers

    def apply(self, servers: list[str], instruction: str, params: dict[str, Any]) -> list[str]:
        """POST one command to each of ``servers`` at once; the request ids they accepted."""
        accepted: list[str] = []

        def one(server: str) -> None:
            code, body = self.api.call(
                server + APPLY, {"instruction": instruction, "params": params}
            )
            log(f"{instruction} {params} -> {server}: {code} {body}")
            if code == 202:
                accepted.append(body["request_id"])

        _together(one, servers)
        return accepted


def _together(job: Callable[[str], None], servers: list[str]) -> None:
    threads = [threading.Thread(target=job, args=(server,)) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def log(message: str) -> None:
    print(f"orchestrator: {message}", file=sys.stderr, flush=True)


def statuses(engines: dict[str, list[dict[str, Any]]]) -> dict[int, str]:
    return {engine["id"]: engine["status"] for found in engines.values() for engine in found}


def wait_for_fault(deployment: Deployment, timeout: float, settle: float) -> dict[int, str]:
    """Probe and poll until some engine is not healthy, then until none is still healthy
    (or ``settle`` seconds passed); the statuses then."""
    deadline = time.monotonic() + timeout
    seen = statuses(deployment.engines())
    while not seen or all(status == "healthy" for status in seen.values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no fault within {timeout}s; statuses {seen}")
        deployment.probe_all()
        time.sleep(0.1)
        seen = statuses(deployment.engines())
    log(f"fault seen: {seen}")
    settle_by = time.monotonic() + settle
    while "healthy" in seen.values() and time.monotonic() < settle_by:
        deployment.probe_all()  # an idle survivor notices a dead peer only on a request
        time.sleep(0.1)
        seen = statuses(deployment.engines())
    return seen


def wait_until(
    deployment: Deployment, done: Callable[[dict[int, Any]], bool], timeout: float, what: str
) -> dict[int, Any]:
    """Poll the status until ``done(engines by id)``; the engines then."""
    deadline = time.monotonic() + timeout
    while True:
        engines = {e["id"]: e for found in deployment.engines().values() for e in found}
        if done(engines):
            return engines
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout}s; engines {engines}")
        time.sleep(0.1)


def retry_everywhere(deployment: Deployment, report: dict[str, Any], timeout: float) -> None:
    """Scenario 1: retry on every server at once, then every engine HEALTHY."""
    ids = deployment.apply(deployment.servers, "retry", {})
    report["commands"].append({"instruction": "retry", "request_ids": ids})

    def settled(engines: dict[int, Any]) -> bool:
        failed = [
            e for e in engines.values() if e.get("last_ft_request_id") in ids and e.get("ft_error")
        ]
        if failed:
            raise RuntimeError(f"retry failed: {failed[0]['ft_error']}")
        return bool(engines) and all(e["status"] == "healthy" for e in engines.values())

    wait_until(deployment, settled, timeout, "every engine HEALTHY after retry")


def scale_down_past(
    deployment: Deployment, dead: list[int], report: dict[str, Any], timeout: float
) -> None:
    """Scenario 2: a retry to the victim must be rejected; then scale_down on the survivors."""
    hosts = {server: [e["id"] for e in found] for server, found in deployment.engines().items()}
    victims = [server for server, ids in hosts.items() if set(ids) & set(dead)]
    survivors = [server for server, ids in hosts.items() if set(ids) - set(dead)]
    ids = deployment.apply(victims, "retry", {})

    def refused(engines: dict[int, Any]) -> bool:
        return all(
            engines[rank].get("last_ft_request_id") in ids and bool(engines[rank].get("ft_error"))
            for rank in dead
            if rank in engines
        )

    shown = wait_until(deployment, refused, timeout, "the victim rejecting retry")
    report["retry_to_victim"] = {r: shown[r].get("ft_error") for r in dead if r in shown}
    params = {"removed_dp_ranks": dead}
    report["commands"].append(
        {
            "instruction": "scale_down",
            "params": params,
            "request_ids": deployment.apply(survivors, "scale_down", params),
        }
    )

    def healed(engines: dict[int, Any]) -> bool:
        live = [e for rank, e in engines.items() if rank not in dead]
        return bool(live) and all(e["status"] == "healthy" for e in live)

    engines = wait_until(deployment, healed, timeout, "every survivor HEALTHY after scale_down")
    # removed_ranks is ftengine's extra field; a vLLM server does not send it.
    report["removed_ranks"] = sorted(
        {r for rank, e in engines.items() if rank not in dead for r in e.get("removed_ranks", dead)}
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    deployment = Deployment(Api(args.api_key, args.http_timeout), args.server, args.prompt, 4)
    report: dict[str, Any] = {"servers": deployment.servers, "commands": []}
    started = time.monotonic()
    baseline = deployment.probe_all()
    report["baseline"] = baseline
    if any(answer is None for answer in baseline.values()):
        raise RuntimeError(f"a server does not answer a completion before any fault: {baseline}")
    log("watching for a fault")
    seen = wait_for_fault(deployment, args.fault_timeout, args.settle_timeout)
    dead = sorted(rank for rank, status in seen.items() if status == "dead")
    report.update(faulted=seen, dead=dead, scenario="scale_down" if dead else "retry")
    fault_at = time.monotonic()
    if dead:
        scale_down_past(deployment, dead, report, args.recovery_timeout)
    else:
        retry_everywhere(deployment, report, args.recovery_timeout)
    report["recovery_s"] = round(time.monotonic() - fault_at, 3)
    serving = [
        s for s, found in deployment.engines().items() if any(e["id"] not in dead for e in found)
    ]
    after = {server: deployment.probe(server) for server in serving}
    report["answers_match"] = bool(after) and all(after[s] == baseline[s] for s in after)
    report["after"] = after
    report["seconds"] = round(time.monotonic() - started, 3)
    report["ok"] = report["answers_match"] and args.expect in ("any", report["scenario"])
    return report


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", action="append", required=True, help="an API server's base URL")
    parser.add_argument("--api-key", default=None, help="bearer key of the servers")
    parser.add_argument("--expect", choices=("any", "retry", "scale_down"), default="any")
    parser.add_argument(
        "--prompt",
        type=lambda s: [int(t) for t in s.split(",")],
        default=[1, 2, 3, 4],
        help="probe prompt token ids, comma-separated",
    )
    parser.add_argument("--fault-timeout", type=float, default=300.0)
    parser.add_argument("--settle-timeout", type=float, default=30.0)
    parser.add_argument("--recovery-timeout", type=float, default=120.0)
    parser.add_argument("--http-timeout", type=float, default=60.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        report = run(args)
    except (RuntimeError, TimeoutError, KeyError, IndexError, TypeError) as error:
        report = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
