"""Children running roles of :mod:`tests.nixl.peer` (or of another module, such as
:mod:`kvtierd.testing.nixl_reader`), watched from the pytest process (which never loads NIXL)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import pytest

import kvtierd

__all__ = ["LINE_TIMEOUT_S", "Child", "pull"]

ROOT = Path(kvtierd.__file__).resolve().parent.parent
#: The longest wait for a child's next line: it starts Python and NIXL, which a loaded machine
#: (a test run beside a benchmark) can stretch from about a second to tens of seconds. A child
#: that ends sooner fails the wait at once.
LINE_TIMEOUT_S = 60.0


class Child:
    """A child running one role of ``module`` (:mod:`tests.nixl.peer` by default); its stdout
    read line by line by a thread, so that a wait for a line ends when the line comes, when the
    child ends, or after :data:`LINE_TIMEOUT_S`."""

    def __init__(
        self,
        *args: str,
        module: str = "tests.nixl.peer",
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``prefix`` goes before the command line (``ip netns exec NAME`` runs the child on
        another "host"); ``env`` adds to the environment."""
        environment = dict(os.environ, **(env or {}))
        environment["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT), environment.get("PYTHONPATH")])
        )
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=environment,
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


def pull(directory: Path, case: str) -> dict[str, Any]:
    """Run a puller of ``case`` to its end; its JSON line (it must exit 0)."""
    puller = Child("puller", str(directory), case)
    result = puller.result()
    puller.finish()
    return result
