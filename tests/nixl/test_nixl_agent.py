"""NIXL agents in two real processes (:mod:`tests.nixl.peer`): what kvtierd's agent owner
promises, and what NIXL itself does not (which is why kvtierd checks leases itself).

Every process that loads NIXL segfaults at interpreter exit, so the pytest process never does:
the children end through ``exit_process``, and each test checks that they exit 0, not 139.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

import kvtierd

pytestmark = [pytest.mark.usefixtures("nixl_works"), pytest.mark.timeout(300)]

ROOT = Path(kvtierd.__file__).resolve().parent.parent
#: The longest wait for a child's next line: it starts Python and NIXL, which a loaded machine
#: (a test run beside a benchmark) can stretch from about a second to tens of seconds. A child
#: that ends sooner fails the wait at once.
LINE_TIMEOUT_S = 60.0


class _Child:
    """A child running one role of :mod:`tests.nixl.peer`; its stdout read line by line by a
    thread, so that a wait for a line ends when the line comes, when the child ends, or after
    :data:`LINE_TIMEOUT_S`."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.nixl.peer", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stdout, self.lines.put)),
            threading.Thread(target=self._read, args=(self.process.stderr, self.stderr.append)),
        ]
        for reader in self._readers:
            reader.daemon = True
            reader.start()

    @staticmethod
    def _read(stream: IO[str] | None, put: Callable[[str], None]) -> None:
        assert stream is not None
        for line in stream:
            put(line)
        put("")

    def line_starting(self, prefix: str) -> str:
        """The first line printed that starts with ``prefix`` (NIXL logs to stdout too)."""
        while True:
            try:
                line = self.lines.get(timeout=LINE_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"no {prefix!r} line within {LINE_TIMEOUT_S:g} s")
            if not line:
                self.process.wait()
                pytest.fail(
                    f"the child ended ({self.process.returncode}) before {prefix!r}: "
                    f"{''.join(self.stderr)[-2000:]}"
                )
            if line.startswith(prefix):
                return line

    def result(self) -> dict[str, Any]:
        """The puller's JSON line."""
        outcome: dict[str, Any] = json.loads(self.line_starting("{"))
        return outcome

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def finish(self, command: str | None = None) -> None:
        """Send ``command``, close stdin and check that the child exits 0 (not 139)."""
        if command is not None:
            self.send(command)
        self.close()
        assert self.process.returncode == 0, "".join(self.stderr)[-2000:]

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.close()

    def close(self) -> None:
        assert self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it was killed
            self.process.stdin.close()
        try:
            self.process.wait(timeout=LINE_TIMEOUT_S)
        finally:
            if self.process.returncode is None:
                self.process.kill()
                self.process.wait()
            for reader in self._readers:
                reader.join(timeout=LINE_TIMEOUT_S)
            for stream in (self.process.stdout, self.process.stderr):
                assert stream is not None
                stream.close()


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[_Child]:
    """An owner process, ready: its region's metadata and descriptors are in ``tmp_path``."""
    child = _Child("owner", str(tmp_path))
    try:
        child.line_starting("ready")
        yield child
    finally:
        if child.process.returncode is None:
            child.kill()


def _pull(directory: Path, case: str) -> dict[str, Any]:
    puller = _Child("puller", str(directory), case)
    result = puller.result()
    puller.finish()
    return result


@pytest.mark.parametrize("case", ["sync", "asyncio", "trio"])
def test_another_process_pulls_extents_of_a_region_byte_exact(
    owner: _Child, tmp_path: Path, case: str
) -> None:
    """With the metadata of that one registration, as a tenant's client gets its region's."""
    result = _pull(tmp_path, case)
    assert result["error"] == ""
    assert result["sha256"] == result["expected"]
    owner.finish("exit")


def test_the_owner_refuses_to_describe_past_its_region(owner: _Child, tmp_path: Path) -> None:
    refused = (tmp_path / "refused.txt").read_text()
    assert refused.startswith("kvtierd.errors.InvalidRequestError"), refused
    assert "outside registered memory" in refused
    owner.finish("exit")


def test_truncated_descriptors_are_refused_before_nixl_sees_them(
    owner: _Child, tmp_path: Path
) -> None:
    result = _pull(tmp_path, "short")
    assert result["error"].startswith("kvtierd.errors.InvalidRequestError"), result
    owner.finish("exit")


def test_a_transfer_nixl_refuses_raises_transfer_error(owner: _Child, tmp_path: Path) -> None:
    """NIXL's own exception (``nixlNotFoundError`` for an agent never loaded) comes out as
    kvtierd's ``TransferError``, and the puller still exits cleanly."""
    result = _pull(tmp_path, "unknown-peer")
    assert result["error"].startswith("kvtierd.nixl.agent.TransferError"), result
    assert "nixlNotFoundError" in result["error"]
    owner.finish("exit")


def test_nixl_does_not_revoke_a_peer_after_deregistration(owner: _Child, tmp_path: Path) -> None:
    """NIXL 1.5.1 over UCX: a peer that loaded the metadata still pulls the old bytes after the
    owner deregistered them. So deregistration is no access control, and a kvtierd client
    re-checks its lease's generation after every transfer (docs/nixl.md). If this starts
    failing, NIXL began to revoke: say so in docs/nixl.md."""
    puller = _Child("puller", str(tmp_path), "again")
    puller.line_starting("pulled")
    owner.send("deregister")
    owner.line_starting("deregistered")
    puller.send("go")
    result = puller.result()
    puller.finish()
    owner.finish("exit")
    assert result["error"] == ""
    assert result["sha256"] == result["expected"]


def test_the_owner_serves_on_after_a_puller_is_killed(owner: _Child, tmp_path: Path) -> None:
    first = _Child("puller", str(tmp_path), "again")
    first.line_starting("pulled")
    first.kill()
    assert first.process.returncode == -signal.SIGKILL
    result = _pull(tmp_path, "sync")
    assert result["error"] == ""
    assert result["sha256"] == result["expected"]
    owner.finish("exit")
