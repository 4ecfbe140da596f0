"""``/health``, ``/ready`` and the socket of a daemon that is still starting: a real daemon
pre-faulting a large arena, probed over HTTP and over its socket while it does."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import anyio
import pytest

from kvtierd.client import StartingError, connect
from kvtierd.client.base import init_request
from kvtierd.protocol import ClientConnection
from kvtierd.protocol.messages import DoctorRequest
from kvtierd.server import daemon as daemon_module
from kvtierd.server.notify import Notifier
from kvtierd.server.readiness import DaemonPhase, Readiness
from kvtierd.store.lifecycle import OpenPhase
from kvtierd.testing import DaemonProcess, free_port
from tests.integration.test_metrics import http_get

T = TypeVar("T")

ARENA = "3G"  # pre-faulting it takes seconds here: long enough to be seen starting


def probe(port: int, path: str) -> tuple[int, dict[str, str]] | None:
    try:
        status, body = http_get(f"http://127.0.0.1:{port}{path}")
    except OSError:  # not listening yet
        return None
    return status, json.loads(body)


@pytest.mark.skipif(
    os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") < 8 << 30,
    reason="needs 8 GiB of memory for a 3 GiB arena that takes seconds to start",
)
def test_a_starting_daemon_says_so_then_serves(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "kvtierd.toml"
    config.write_text(f"[daemon]\nmetrics_port = {port}\n")
    socket_path = tmp_path / "kvtierd.sock"
    log = (tmp_path / "daemon.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtierd", "--config", str(config), "--socket", str(socket_path),
         "--data-dir", str(tmp_path / "data"), "--dram-size", ARENA, "--nvme-size", "64M"],
        stdout=log, stderr=log,
    )  # fmt: skip
    try:
        seen_starting: list[dict[str, str]] = []
        refusals: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "daemon.log").read_text()
            ready = probe(port, "/ready")
            if ready is None:
                time.sleep(0.02)
                continue
            status, body = ready
            if status == 200:
                break
            assert status == 503
            assert body["status"] == "starting"
            seen_starting.append(body)
            health = probe(port, "/health")
            assert health is not None
            assert health[0] == 200  # starting is alive
            if socket_path.is_socket():
                try:
                    with connect(socket_path, timeout_s=5):
                        break  # it became ready between the two probes
                except StartingError as exc:
                    refusals.append(str(exc))
            time.sleep(0.05)
        else:
            raise AssertionError("the daemon never became ready")
        assert seen_starting, "the listener was never seen before the daemon was ready"
        assert all(b["reason"].startswith("starting: ") for b in seen_starting)
        assert any("pre-fault" in b["reason"] or "arena" in b["reason"] for b in seen_starting)
        assert all(r.startswith("starting: ") for r in refusals)
        # ready now: both probes 200, the socket serves
        assert probe(port, "/ready") == (
            200,
            {"status": "ready", "reason": f"serving on {socket_path}"},
        )
        health = probe(port, "/health")
        assert health is not None
        assert health[0] == 200
        assert health[1]["status"] == "ok"
        with connect(socket_path, timeout_s=5) as client:
            assert client.stats()["version"]
        status, _ = http_get(f"http://127.0.0.1:{port}/nothing-here")
        assert status == 404
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        finally:
            process.kill()
            log.close()


def test_a_stopping_daemon_is_not_ready(tmp_path: Path) -> None:
    """SIGTERM with replies still on their way (a peer that reads none of them holds the drain
    for up to ``shutdown_grace_s``): alive, and ``/ready`` says ``stopping`` until it exits."""
    port = free_port()
    config = f"[daemon]\nmetrics_port = {port}\nshutdown_grace_s = 30\n"
    with DaemonProcess(tmp_path, dram_size="32M", nvme_size="64M", config_text=config) as d:
        assert probe(port, "/ready") == (
            200,
            {"status": "ready", "reason": f"serving on {d.socket}"},
        )
        stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(str(d.socket))
        try:
            conn = ClientConnection()
            stuck.sendall(conn.request(init_request("never-reads"))[1])
            # DOCTOR runs in a task and answers ~1 KiB: 256 of them fill both socket buffers,
            # so replies stay in flight and the drain has to wait for them
            stuck.sendall(b"".join(conn.request(DoctorRequest())[1] for _ in range(256)))
            wait_until("the DOCTORs were never all dispatched", lambda: doctors_dispatched(port))
            assert d.process is not None
            d.process.send_signal(signal.SIGTERM)
            stopping = wait_until(
                "/ready never said stopping",
                lambda: (r := probe(port, "/ready")) is not None and r[0] == 503 and r,
            )
            assert stopping[1]["status"] == "stopping"
            health = probe(port, "/health")
            assert health is not None
            assert health[0] == 200  # stopping, still alive
            assert d.running  # held by the replies nobody reads
        finally:
            stuck.close()  # the replies fail, the sessions end, the daemon stops
        assert d.process.wait(60) == 0  # (a second SIGTERM would end it at once)


def doctors_dispatched(port: int) -> bool:
    """Every DOCTOR has been handled (its duration observed); most replies wait to be sent."""
    _, body = http_get(f"http://127.0.0.1:{port}/metrics")
    done = [
        line
        for line in body.decode().splitlines()
        if line.startswith('kvtierd_request_duration_seconds_count{opcode="DOCTOR"')
    ]
    return bool(done) and float(done[0].rsplit(" ", 1)[1]) >= 256


def wait_until(what: str, probe_: Callable[[], T | bool | None]) -> T:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = probe_()
        if found:
            return found  # type: ignore[return-value]
        time.sleep(0.05)
    raise AssertionError(what)


@pytest.mark.anyio
async def test_each_advance_of_a_start_extends_systemds_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon's start-up reporter with a real notifier on a real datagram socket: one
    EXTEND_TIMEOUT_USEC per advance of the opening, none while it stands still, none once it
    serves."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(path))
        systemd.setblocking(False)
        monkeypatch.setattr(daemon_module, "_EXTEND_EVERY_S", 0.01)
        readiness = Readiness()
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})

        def received() -> list[bytes]:
            out = []
            with contextlib.suppress(BlockingIOError):
                while True:
                    out.append(systemd.recv(4096))
            return out

        async with anyio.create_task_group() as tg:
            tg.start_soon(daemon_module._extend_start_timeout, readiness, notifier)
            await anyio.sleep(0.05)  # it has started, and seen the opening where it is
            assert received() == []
            for done in (1 << 30, 2 << 30):
                readiness.progress.advance(OpenPhase.PREFAULTING, done, 4 << 30)
                with anyio.fail_after(10):
                    await anyio.wait_readable(systemd)
                await anyio.sleep(0.05)  # one per advance, however many checks pass
                assert received() == [
                    b"EXTEND_TIMEOUT_USEC=60000000\nSTATUS=starting: pre-faulting the arena, "
                    + f"{done >> 30}.0 of 4.0 GiB".encode()
                ]
            await anyio.sleep(0.1)  # standing still: nothing more
            assert received() == []
            readiness.progress.advance(OpenPhase.RECOVERING, 12000)
            readiness.phase = DaemonPhase.SERVING  # it serves: no extension
            await anyio.sleep(0.1)
            tg.cancel_scope.cancel()
        assert received() == []
