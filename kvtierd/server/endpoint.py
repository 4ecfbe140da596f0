"""The metrics listener: ``/metrics``, ``/health`` and ``/ready`` on the loopback port.

Theory of operation. A small WSGI server (the standard library's ``wsgiref`` with one thread
per request, what prometheus-client's ``start_http_server`` runs, with request logging off)
answers in its own threads, which never touch the store: ``/metrics`` renders the daemon's
registry (:mod:`kvtierd.server.metrics`: snapshots and thread-safe histograms), ``/health``
and ``/ready`` read :class:`~kvtierd.server.readiness.Readiness` (a few attributes the loop
replaces whole). Every answer to a probe is 200 or 503 with a one-line JSON body
``{"status": ..., "reason": ...}``; any other path is 404.

Bounds. A connection costs a thread and a descriptor, so the server holds at most
``daemon.metrics_max_connections`` at once and closes one more at once, unanswered; a request
must arrive whole within ``daemon.metrics_timeout_s`` (a connection that sends nothing, or
trickles, is closed then), and each write of the answer may take that long. An ``accept`` that
fails for want of descriptors pauses the listener a moment instead of spinning. Failures are
logged at debug level, and the refusals and shortages at most once a minute.

The listener is bound before the store opens, so probes are answered during a long start-up
(``/health`` 200, ``/ready`` 503 ``starting``). The loop's side is :func:`serve_endpoint`: it
beats the heartbeat every :data:`~kvtierd.server.readiness.BEAT_S` and takes a metrics
snapshot every second once the daemon serves.
"""

from __future__ import annotations

import errno
import io
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import anyio
from anyio.abc import TaskStatus
from prometheus_client import make_wsgi_app

from kvtierd.config import DaemonConfig
from kvtierd.server.metrics import Metrics
from kvtierd.server.readiness import BEAT_S, Verdict
from kvtierd.server.throttle import Throttle

__all__ = ["make_app", "serve_endpoint"]

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
_SNAPSHOT_EVERY_S = 1.0
#: How long the metrics listener pauses when ``accept`` finds no descriptor left.
_SHORTAGE_PAUSE_S = 0.1

log = logging.getLogger("kvtierd.metrics")


class _Handler(WSGIRequestHandler):
    """wsgiref's handler, quiet, with the request's deadline (``timeout``, set per server)."""

    def log_message(self, format: str, *args: Any) -> None:
        """A probe every few seconds must not fill the journal."""

    def setup(self) -> None:
        super().setup()  # the socket's timeout is ``timeout`` from here on
        assert self.timeout is not None
        deadline_s = time.monotonic() + self.timeout
        self.rfile.close()  # the socket's file, replaced by one that keeps the deadline
        self.rfile = io.BufferedReader(_ReadBefore(self.connection, deadline_s))

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # the headers are in: the answer is next
        self.connection.settimeout(self.timeout)
        return parsed


class _ReadBefore(io.RawIOBase):
    """A socket's reads, each given what is left until ``deadline_s`` (then TimeoutError)."""

    def __init__(self, sock: socket.socket, deadline_s: float) -> None:
        self._sock = sock
        self._deadline_s = deadline_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left_s = self._deadline_s - time.monotonic()
        if left_s <= 0:
            raise TimeoutError("the request did not arrive in time")
        self._sock.settimeout(left_s)
        return self._sock.recv_into(buffer)


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``max_connections`` of them."""

    daemon_threads = True  # a slow scraper never holds the daemon's exit
    block_on_close = False

    def __init__(
        self, address: tuple[str, int], handler: type[_Handler], *, max_connections: int
    ) -> None:
        super().__init__(address, handler)
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._failures = Throttle()  # used by the accepting thread only

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self._failures.report(log, logging.ERROR, "accept",
                                      "cannot accept on the metrics port: %s", exc)  # fmt: skip
                time.sleep(_SHORTAGE_PAUSE_S)  # the listener stays readable: do not spin
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._failures.report(
                log, logging.WARNING, "cap",
                "the metrics port serves %d connections (daemon.metrics_max_connections): "
                "closing new ones at once", self.max_connections,
            )  # fmt: skip
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # no thread was started
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A scraper that went away or timed out: nothing the daemon must hear about."""
        log.debug("metrics connection from %s ended: %r", client_address, sys.exc_info()[1])


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

    class Server(_BoundedServer):
        address_family = family

    class Handler(_Handler):
        timeout = config.metrics_timeout_s

    address = (config.metrics_address, config.metrics_port)
    server = Server(address, Handler, max_connections=config.metrics_max_connections)
    server.set_app(app)
    return server


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
