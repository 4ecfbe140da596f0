"""NIXL, proved and used in child processes only: every process that loads NIXL segfaults at
interpreter exit, so the pytest process never imports it (the children end through
``exit_process``, and the tests check that they exit 0, not 139)."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

import kvtierd
from kvtierd.nixl.probe import NixlOutcome, probe_nixl

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("nixl") is None,
        reason="NIXL is not installed (pip install 'kvtierd[nixl]')",
    ),
    pytest.mark.timeout(60),
]

ROOT = Path(kvtierd.__file__).resolve().parent.parent
LINE_TIMEOUT_S = 20.0


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


class _Child:
    """A child running one role of :mod:`tests.nixl.peer`, its stdout read line by line by a
    thread (so a wait for a line can time out)."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.nixl.peer", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=_env(),
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stdout, self.lines.put)),
            threading.Thread(target=self._read, args=(self.process.stderr, self.stderr.append)),
        ]
        for reader in self._readers:
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
                pytest.fail(f"no {prefix!r} line within {LINE_TIMEOUT_S} s")
            if not line:
                pytest.fail(f"the child ended before {prefix!r}: {''.join(self.stderr)[-2000:]}")
            if line.startswith(prefix):
                return line

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

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=LINE_TIMEOUT_S)
        finally:
            if self.process.returncode is None:
                self.process.kill()
                self.process.wait()
            for reader in self._readers:
                reader.join()
            for stream in (self.process.stdout, self.process.stderr):
                assert stream is not None
                stream.close()


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[_Child]:
    """An owner process whose region's descriptors are in ``tmp_path``."""
    child = _Child("owner", str(tmp_path))
    try:
        child.line_starting("ready")
        yield child
    finally:
        if child.process.returncode is None:
            child.process.kill()
            child.close()


def _pull(directory: Path, case: str) -> dict[str, Any]:
    puller = _Child("puller", str(directory), case)
    result: dict[str, Any] = json.loads(puller.line_starting("{"))
    puller.finish()
    return result


def test_probe_finds_nixl_working() -> None:
    verdict = probe_nixl()
    assert verdict.ok, verdict
    assert verdict.outcome is NixlOutcome.OK
    assert "UCX" in verdict.detail


def test_probe_of_a_broken_import_says_so(tmp_path: Path) -> None:
    fake = tmp_path / "nixl"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('libnixl.so: cannot open shared object')\n")
    verdict = probe_nixl(env={"PYTHONPATH": str(tmp_path)})
    assert not verdict.ok
    assert verdict.outcome is NixlOutcome.IMPORT_ERROR
    assert "libnixl.so" in verdict.detail


def test_probe_without_a_usable_transport_says_so() -> None:
    verdict = probe_nixl(env={"UCX_TLS": "posix,sysv"})
    assert not verdict.ok
    assert verdict.outcome is NixlOutcome.SELFTEST_FAILED
    assert "NIXL" in verdict.detail


def test_probe_of_a_crashing_child_names_the_signal(tmp_path: Path) -> None:
    fake = tmp_path / "nixl"
    fake.mkdir()
    (fake / "__init__.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    verdict = probe_nixl(env={"PYTHONPATH": str(tmp_path)})
    assert verdict.outcome is NixlOutcome.SIGNAL
    assert verdict.signal == "SIGSEGV"
    assert "memory" in verdict.detail


def test_probe_of_a_hanging_child_times_out(tmp_path: Path) -> None:
    fake = tmp_path / "nixl"
    fake.mkdir()
    (fake / "__init__.py").write_text("import time\ntime.sleep(60)\n")
    verdict = probe_nixl(env={"PYTHONPATH": str(tmp_path)}, timeout_s=1.0)
    assert verdict.outcome is NixlOutcome.TIMEOUT
    assert not verdict.ok


def test_another_process_pulls_extents_of_a_memfd_region(
    owner: _Child, tmp_path: Path
) -> None:
    result = _pull(tmp_path, "extents")
    assert result["error"] == ""
    assert result["sha256"] == result["expected"]
    owner.finish("exit")


@pytest.mark.parametrize("case", ["outside", "short"])
def test_a_pull_of_wrong_descriptors_raises(
    owner: _Child, tmp_path: Path, case: str
) -> None:
    result = _pull(tmp_path, case)
    assert result["error"].startswith("kvtierd."), result
    assert result["elapsed_s"] < 5.0
    owner.finish("exit")


def test_a_pull_after_the_owner_deregistered_raises(
    owner: _Child, tmp_path: Path
) -> None:
    puller = _Child("puller", str(tmp_path), "again")
    puller.line_starting("pulled")
    owner.send("deregister")
    owner.line_starting("deregistered")
    puller.send("go")
    result = json.loads(puller.line_starting("{"))
    puller.finish()
    owner.finish("exit")
    assert result["error"].startswith("kvtierd.nixl.agent.TransferError"), result
