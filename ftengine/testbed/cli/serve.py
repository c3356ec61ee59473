"""Serve vLLM's fault-tolerance API and OpenAI completions over a CPU reference cluster."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from types import FrameType

from ftengine.errors import ConfigError
from ftengine.policies.registry import check_name
from ftengine.testbed.cli import launch
from ftengine.testbed.cli.extras import testbed_extra
from ftengine.testbed.control.auth import API_KEY_ENV, check_bind

COMMAND = "serve"
logger = logging.getLogger(__name__)


def register(parser: argparse.ArgumentParser) -> None:
    """Add ``serve``'s flags."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on POSTs (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--port-file", type=Path, default=None, help="write the bound port here once serving"
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn/ftengine log level")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the checkpoint path, as vLLM does)",
    )
    launch.add_run_args(parser, launch.CheckpointSize())
    parser.set_defaults(func=run)


def _terminate(signum: int, _frame: FrameType | None) -> None:
    # SystemExit unwinds through the finally blocks that shut the cluster down.
    raise SystemExit(128 + signum)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot bind {host}:{port} ({exc}); pick another --port") from exc
    sock.listen(128)
    return sock


def run(args: argparse.Namespace) -> int:
    """Bind, launch the cluster, serve until SIGINT/SIGTERM, then shut everything down."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    with testbed_extra(COMMAND):  # the server's packages, before anything binds or starts
        importlib.import_module("uvicorn")
        importlib.import_module("ftengine.testbed.control.app")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        check_name(args.policy)  # a bad policy or import path fails before anything starts
        check_bind(args.host, api_key)
        sock = _bind(args.host, args.port)
    except ConfigError as exc:
        print(f"ftengine serve: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    try:
        with launch.run_checkpoint(args) as checkpoint:
            return _serve(args, sock, checkpoint, api_key)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock: socket.socket, checkpoint: Path, key: str | None) -> int:
    import uvicorn

    from ftengine.testbed.cluster import Cluster
    from ftengine.testbed.cluster.serving import ServingLoop
    from ftengine.testbed.control.app import create_app
    from ftengine.testbed.control.openai_routes import Completions
    from ftengine.testbed.control.served_model import ServedModel

    model = ServedModel.from_checkpoint(checkpoint, args.served_model_name)
    cluster = Cluster.launch(launch.cluster_config(args, checkpoint))
    serving = ServingLoop(cluster, resumption=cluster.resumption()).start()
    try:
        app = create_app(cluster, completions=Completions(serving, model), api_key=key)
        stop_observer = app.state.plane.observe_every(0.25)
        server = uvicorn.Server(
            uvicorn.Config(app, log_level=args.log_level.lower(), lifespan="off")
        )
        port = sock.getsockname()[1]
        if args.port_file is not None:
            # Written whole then renamed, so a reader never sees a partial port number.
            partial = args.port_file.with_suffix(".partial")
            partial.write_text(f"{port}\n")
            partial.replace(args.port_file)
        print(f"ftengine serve: http://{args.host}:{port} (pid {os.getpid()})", flush=True)
        try:
            server.run(sockets=[sock])
        finally:
            stop_observer()
    finally:
        serving.close()
        cluster.shutdown()
    return 0
