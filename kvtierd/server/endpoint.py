"""The metrics listener: ``/metrics``, ``/health`` and ``/ready`` on the loopback port.

Theory of operation. A small WSGI server (the standard library's ``wsgiref`` with one thread
per request, what prometheus-client's ``start_http_server`` runs, with request logging off)
answers in its own threads, which never touch the store: ``/metrics`` renders the daemon's
registry (:mod:`kvtierd.server.metrics`: snapshots and thread-safe histograms), ``/health``
and ``/ready`` read :class:`~kvtierd.server.readiness.Readiness` (a few attributes the loop
replaces whole). Every answer to a probe is 200 or 503 with a one-line JSON body
``{"status": ..., "reason": ...}``; any other path is 404.

Bounds. A connection costs a thread and a descriptor, and the port must answer the probes
through a flood: a liveness probe that fails restarts a healthy daemon, which loses what DRAM
held. The port is loopback only, so every peer shares 127.0.0.1 (and a local process may take
any address of 127.0.0.0/8): a cap per source address would not hold. Instead:

* a request's line and headers must arrive within ``daemon.metrics_request_timeout_s``, and at
  most ``daemon.metrics_max_connections`` connections are still sending theirs at once: a new
  connection shuts the oldest of them down (its thread reads EOF and ends). A slowloris peer
  therefore holds no slot a probe needs; a probe sends its request at once, so it would take
  ``metrics_max_connections`` newer connections within that moment to close it;
* ``/health`` and ``/ready`` are answered without a slot (their answer is a few bytes that
  any socket buffer takes); anything else takes one of ``daemon.metrics_max_connections``
  answer slots, and is answered 503 when none is free (a scraper that reads slowly holds one
  for ``daemon.metrics_timeout_s`` per write at most);
* the threads are at most :func:`metrics_descriptors` (both caps and :data:`PROBE_ROOM`), past
  which a new connection is closed at once, unanswered.

An ``accept`` that fails for want of descriptors pauses the listener a moment instead of
spinning. Failures are logged at debug level, and the refusals, evictions and shortages at most
once a minute.

The listener is bound before the store opens, so probes are answered during a long start-up
(``/health`` 200, ``/ready`` 503 ``starting``). The loop's side is :func:`serve_endpoint`: it
beats the heartbeat every :data:`~kvtierd.server.readiness.BEAT_S` and takes a metrics
snapshot every second once the daemon serves.
"""

from __future__ import annotations

import contextlib
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

__all__ = ["PROBE_ROOM", "make_app", "metrics_descriptors", "serve_endpoint"]

StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
_SNAPSHOT_EVERY_S = 1.0
#: How long the metrics listener pauses when ``accept`` finds no descriptor left.
_SHORTAGE_PAUSE_S = 0.1
#: The paths answered without a slot of ``daemon.metrics_max_connections``.
_PROBES = frozenset({"/health", "/ready"})
#: Threads (and descriptors) the metrics port may hold besides its two caps: probes being
#: answered, and evicted connections on their way out.
PROBE_ROOM = 8


def metrics_descriptors(max_connections: int) -> int:
    """The descriptors the metrics port holds at most: ``max_connections`` reading their
    request, ``max_connections`` answering a scrape, and :data:`PROBE_ROOM`."""
    return 2 * max_connections + PROBE_ROOM


log = logging.getLogger("kvtierd.metrics")


class _Handler(WSGIRequestHandler):
    """wsgiref's handler, quiet, with the request's deadline (:attr:`request_timeout_s`) and
    each write's (``timeout``), set per server; what is not a probe takes an answer slot."""

    def log_message(self, format: str, *args: Any) -> None:
        """A probe every few seconds must not fill the journal."""

    #: ``daemon.metrics_request_timeout_s``: the request line and headers arrive within it.
    request_timeout_s = 2.0
    server: _BoundedServer
    _scraping = False

    def setup(self) -> None:
        super().setup()  # the socket's timeout is ``timeout`` from here on
        deadline_s = time.monotonic() + self.request_timeout_s
        self.rfile.close()  # the socket's file, replaced by one that keeps the deadline
        self.rfile = io.BufferedReader(_ReadBefore(self.connection, deadline_s))

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # the headers are in: the answer is next
        self.server.done_reading(self.connection)
        self.connection.settimeout(self.timeout)
        if not parsed:
            return False
        if self.path.partition("?")[0] in _PROBES:
            return True  # a probe's answer is a few bytes: it never waits for a slot
        self._scraping = self.server.take_scrape()
        if not self._scraping:
            self.send_error(503, "busy: daemon.metrics_max_connections answers in progress")
        return self._scraping

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self._scraping:
                self._scraping = False
                self.server.give_scrape_back()


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
    """A thread per connection: at most ``max_connections`` still reading their request (a
    new one closes the oldest of them), ``max_connections`` answering what is not a probe,
    and :func:`metrics_descriptors` in all."""

    daemon_threads = True  # a slow scraper never holds the daemon's exit
    block_on_close = False

    def __init__(
        self, address: tuple[str, int], handler: type[_Handler], *, max_connections: int
    ) -> None:
        super().__init__(address, handler)
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(metrics_descriptors(max_connections))
        self._scrapes = threading.BoundedSemaphore(max_connections)
        #: The connections still reading their request, oldest first; its lock also orders
        #: a shutdown by :meth:`process_request` before the connection's close.
        self._reading: dict[socket.socket, None] = {}
        self._lock = threading.Lock()
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
        with self._lock:
            if len(self._reading) >= self.max_connections:
                self._evict_oldest()
        if not self._slots.acquire(blocking=False):
            self._failures.report(
                log, logging.WARNING, "cap",
                "the metrics port serves %d connections (twice daemon.metrics_max_connections "
                "and the probes'): closing new ones at once", metrics_descriptors(
                    self.max_connections),
            )  # fmt: skip
            self.shutdown_request(request)
            return
        with self._lock:
            self._reading[request] = None
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.done_reading(request)
            self._slots.release()  # no thread was started
            raise

    def _evict_oldest(self) -> None:
        """Close (shut down) the connection reading its request longest: a slowloris peer
        holds no slot a new connection needs (``self._lock`` is held)."""
        oldest = next(iter(self._reading))
        del self._reading[oldest]
        self._failures.report(
            log, logging.WARNING, "evict",
            "the metrics port has %d connections still sending their request "
            "(daemon.metrics_max_connections): closing the oldest for each new one",
            self.max_connections,
        )  # fmt: skip
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)  # its thread reads EOF and ends

    def done_reading(self, request: socket.socket) -> None:
        """``request``'s request is in (or it ends): it can no longer be evicted."""
        with self._lock:
            self._reading.pop(request, None)

    def take_scrape(self) -> bool:
        """A slot to answer what is not a probe; ``False`` when all are taken."""
        return self._scrapes.acquire(blocking=False)

    def give_scrape_back(self) -> None:
        self._scrapes.release()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.done_reading(request)  # before its close: no shutdown of a reused descriptor
            self.shutdown_request(request)
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
        request_timeout_s = config.metrics_request_timeout_s

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
