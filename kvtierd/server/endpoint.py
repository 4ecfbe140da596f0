"""The metrics listener: ``/metrics``, ``/health`` and ``/ready`` on the loopback port.

Theory of operation. A small WSGI server (the standard library's ``wsgiref`` with one thread
per request, what prometheus-client's ``start_http_server`` runs, with request logging off)
answers in its own threads, which never touch the store: ``/metrics`` renders the daemon's
registry (:mod:`kvtierd.server.metrics`: snapshots and thread-safe histograms), ``/health``
and ``/ready`` read :class:`~kvtierd.server.readiness.Readiness` (a few attributes the loop
replaces whole). Every answer to a probe is 200 or 503 with a one-line JSON body
``{"status": ..., "reason": ...}``; any other path is 404.

The listener is bound before the store opens, so probes are answered during a long start-up
(``/health`` 200, ``/ready`` 503 ``starting``). The loop's side is :func:`serve_endpoint`: it
beats the heartbeat every :data:`~kvtierd.server.readiness.BEAT_S` and takes a metrics
snapshot every second once the daemon serves.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import anyio
from anyio.abc import TaskStatus
from prometheus_client import make_wsgi_app

from kvtierd.config import DaemonConfig
from kvtierd.server.metrics import Metrics
from kvtierd.server.readiness import BEAT_S, Verdict

__all__ = ["make_app", "serve_endpoint"]

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
_SNAPSHOT_EVERY_S = 1.0


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """A probe every few seconds must not fill the journal."""


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the daemon's exit


def make_app(metrics: Metrics) -> WsgiApp:
    """The WSGI application: ``/metrics``, ``/health``, ``/ready``, 404 for anything else."""
    render = make_wsgi_app(metrics.registry)
    readiness = metrics.readiness

    def probe(verdict: Verdict, start_response: StartResponse) -> list[bytes]:
        body = verdict.body()
        status = "200 OK" if verdict.ok else "503 Service Unavailable"
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        start_response(status, headers)
        return [body]

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return render(environ, start_response)  # type: ignore[no-any-return]
        if path == "/health":
            return probe(readiness.health(), start_response)
        if path == "/ready":
            return probe(readiness.ready(), start_response)
        body = b"not found: try /metrics, /health or /ready\n"
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [body]

    return app


def _bind(config: DaemonConfig, app: WsgiApp) -> WSGIServer:
    family = socket.getaddrinfo(config.metrics_address, config.metrics_port)[0][0]

    class Server(_ThreadingServer):
        address_family = family

    return make_server(
        config.metrics_address, config.metrics_port, app, Server, handler_class=_QuietHandler
    )


async def serve_endpoint(
    config: DaemonConfig,
    metrics: Metrics,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Bind the metrics listener, then beat and snapshot until cancelled. Raises ``OSError``
    when the port cannot be bound."""
    server = await anyio.to_thread.run_sync(_bind, config, make_app(metrics))
    thread = threading.Thread(
        target=server.serve_forever, name="kvtierd-metrics", kwargs={"poll_interval": 0.5}
    )
    thread.daemon = True
    thread.start()
    try:
        task_status.started()
        readiness = metrics.readiness
        last_snapshot_s = 0.0
        while True:
            readiness.beat()
            now = time.monotonic()
            if now - last_snapshot_s >= _SNAPSHOT_EVERY_S:
                metrics.refresh()
                last_snapshot_s = now
            await anyio.sleep(BEAT_S)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(server.shutdown)
            server.server_close()
            await anyio.to_thread.run_sync(thread.join, 5.0)
