"""The engine link every adapter reaches the daemon through, against a real daemon that goes
away and comes back: misses instead of errors, one "unreachable" per outage, attempts spaced by
a back-off while it is away, a new connection after a restart, refusals that keep the
connection, one region tensor per session."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtierd.engines.link import EngineLink, NamespaceSpec, Session
from kvtierd.errors import (
    BlockNotFoundError,
    BrokenConnectionError,
    ClosedError,
    InvalidRequestError,
    NoSpaceError,
    is_connection_loss,
)
from kvtierd.keys import chain_keys
from kvtierd.testing import DaemonProcess

pytestmark = pytest.mark.timeout(180)

SPEC = NamespaceSpec("link", block_bytes=4096)
BLOCK = np.arange(4096, dtype=np.uint32).astype(np.uint8).tobytes()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    process = DaemonProcess(tmp_path / "kvtierd")
    process.start(120)
    try:
        yield process
    finally:
        process.kill()


def _link(daemon: DaemonProcess) -> EngineLink:
    return EngineLink(str(daemon.socket), client_name="test-link", timeout_s=30)


def _put(session: Session) -> int:
    ns = session.namespace(SPEC)
    keys = chain_keys(range(32), 16, ns.key_salt)
    return ns.put(keys, [BLOCK, BLOCK])


def test_is_connection_loss_tells_a_lost_connection_from_a_refusal() -> None:
    assert is_connection_loss(BrokenConnectionError("gone"))
    assert is_connection_loss(ClosedError("closed"))
    assert is_connection_loss(ConnectionResetError(104, "reset"))
    assert not is_connection_loss(NoSpaceError("full"))
    assert not is_connection_loss(InvalidRequestError("bad"))
    assert not is_connection_loss(ValueError("not ours"))


def test_an_unreachable_daemon_is_a_miss_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    link = EngineLink(str(tmp_path / "none.sock"), client_name="test-link")
    with caplog.at_level(logging.DEBUG, logger="kvtierd.engines"):
        assert [link.call("lookup", _put, -1) for _ in range(3)] == [-1, -1, -1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("kvtierd unreachable, serving without it")
    assert link.failures == 3
    assert link.opens == 0


def test_a_restarted_daemon_is_reached_on_a_new_connection(daemon: DaemonProcess) -> None:
    link = _link(daemon)
    assert link.call("put", _put, -1) == 2
    first = link.session()
    daemon.kill()
    daemon.start(120)
    # the dead session is found by a poll before the call, or lost under it and retried
    assert link.call("put", _put, -1) in (0, 2)  # 0: the NVMe tier kept both
    assert link.session() is not first
    assert link.opens == 2
    assert link.failures == 0
    link.close()
    assert link.call("put", _put, -1) == -1  # closed: every call is a miss
    with pytest.raises(ClosedError):
        link.session()


def test_a_refusal_is_a_miss_that_keeps_the_connection(daemon: DaemonProcess) -> None:
    link = _link(daemon)

    def read_missing(session: Session) -> int:
        ns = session.namespace(SPEC)
        with ns.lease([b"\x01" * 16]):
            return 1

    assert link.call("read", read_missing, 0) == 0
    assert link.failures == 1
    session = link.session()
    assert link.call("put", _put, -1) == 2
    assert link.session() is session
    assert link.opens == 1
    with pytest.raises(BlockNotFoundError):
        read_missing(session)
    link.close()


def test_one_region_tensor_per_session(daemon: DaemonProcess) -> None:
    link = _link(daemon)
    session = link.session()
    ns = session.namespace(SPEC)
    assert session.namespace(SPEC) is ns  # opened once
    arena = session.arena(ns)
    assert session.arena(ns) is arena
    assert arena.numel() == len(ns.arena_buffer())
    assert session.with_room(lambda: _put(session)) == 2
    lease_view = ns.lease(chain_keys(range(32), 16, ns.key_salt))
    with lease_view as lease:
        extent = lease.extents[0]
        assert bytes(arena[extent.offset : extent.offset + extent.length].numpy()) == BLOCK
    link.close()


def test_a_daemon_away_is_knocked_on_after_a_backoff_not_on_every_call(tmp_path: Path) -> None:
    """While the daemon is away each call answers its miss at once, and the link tries to
    connect again only once the client's back-off (with jitter) has passed: an engine's threads
    do not knock on every call while the daemon starts. It is reached once it serves."""
    daemon = DaemonProcess(tmp_path / "kvtierd")
    link = _link(daemon)
    assert [link.call("put", _put, -1) for _ in range(200)] == [-1] * 200
    assert link.failures == 200
    assert 1 <= link.attempts <= 10  # 200 calls, a few attempts (however slow the machine)
    daemon.start(120)
    try:
        for _ in range(400):  # at most 1.25 s between attempts: reached well within this
            if link.call("put", _put, -1) != -1:
                break
            time.sleep(0.05)
        assert link.opens == 1
        assert link.call("put", _put, -1) in (0, 2)
    finally:
        link.close()
        daemon.kill()
