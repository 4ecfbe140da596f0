"""Real components for tests, tools and demos, shared so that neither imports the other.

``DaemonProcess`` runs ``python -m kvtierd`` with its own socket and data directory, waits until
the socket answers INIT (``kvtierd.client.connect``), and stops it with SIGTERM (``stop``) or
SIGKILL (``kill``). Its log is kept in ``<dir>/daemon.log`` and printed when start-up fails.

Beside it: real ``redis-server`` processes (:mod:`.redis_server`), several hosts on one machine
(:mod:`.netns`), the NIXL reader child (:mod:`.nixl_reader`), and the crash soak's loop and
attackers (:mod:`.crash`, :mod:`.remote_attacks`), which ``tools/soak_crash.py`` runs long and the
crash tests short; the engines' helpers for tests, benchmarks and the demo: the real SmolLM2 model
(:mod:`.smollm2`), long prompts (:mod:`.hf_prompts`), the fidelity comparison (:mod:`.hf_fidelity`),
a vLLM engine in a child process (:mod:`.vllm_process`), and LMCache's connector over a host KV
tensor (:mod:`.lmcache_cpu`). Where a component is missing here, :func:`skip` skips the calling
test; the modules tools use import pytest only then. The pytest fixtures (:mod:`.fixtures`) and the
lower-tier contract suite (:mod:`.tier_contract`) are for test suites and import it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from kvtierd.client import DaemonNotRunningError, StartingError, connect
from kvtierd.config import default_data_dir, default_socket_path
from kvtierd.testing.service import ServiceManager

__all__ = [
    "DaemonProcess",
    "ServiceManager",
    "activated_prefix",
    "free_port",
    "skip",
    "terminate",
    "wait_until_serving",
]


def skip(reason: str) -> NoReturn:
    """Skip the calling test for ``reason`` (pytest's ``skip``, imported only then)."""
    import pytest

    pytest.skip(reason)


def terminate(process: subprocess.Popen[bytes], timeout_s: float) -> int:
    """SIGTERM ``process`` unless it has exited, and wait for it; its exit status. Raises
    :class:`subprocess.TimeoutExpired` when it outlives ``timeout_s`` (the caller kills it)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    return process.wait(timeout_s)


def wait_until_serving(
    socket: Path, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 30.0
) -> None:
    """Return once the daemon at ``socket`` answers INIT as a serving daemon.

    The socket is bound before the store opens, so a bound socket is not yet a ready daemon: until
    it is, connections get :class:`~kvtierd.errors.StartingError`. Raises ``RuntimeError`` with the
    log if ``process`` exits or ``timeout_s`` passes first; any other answer propagates.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvtierd exited with {process.returncode}:\n{_log(log_path)}")
        try:
            with connect(socket, timeout_s=5):
                return
        # not bound yet, still starting, or a start that failed closing it (poll() says so)
        except (DaemonNotRunningError, StartingError, ConnectionError):
            time.sleep(0.05)
    raise RuntimeError(f"kvtierd did not become ready in {timeout_s} s:\n{_log(log_path)}")


def _log(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


#: Run by the daemon's process before it execs the daemon: the passed descriptors from 3 on, in
#: order, and ``LISTEN_PID`` this process's pid, as systemd passes a socket unit's sockets and
#: the service's file-descriptor store.
_ACTIVATE = (
    "import fcntl, os, sys\n"
    "given = [int(fd) for fd in sys.argv[1].split(',')]\n"
    "high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1024) for fd in given]\n"
    "for fd in given: os.close(fd)\n"
    "for number, fd in enumerate(high, start=3): os.dup2(fd, number); os.close(fd)\n"
    "os.environ['LISTEN_PID'] = str(os.getpid())\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def activated_prefix(*fds: int) -> list[str]:
    """A command prefix that runs the command after it with descriptors ``fds`` (pass them with
    ``pass_fds``) as descriptors 3, 4, ... and ``LISTEN_PID`` its own pid: systemd's socket
    activation, with ``LISTEN_FDS`` (and ``LISTEN_FDNAMES``) left to the caller's
    environment."""
    return [sys.executable, "-c", _ACTIVATE, ",".join(str(fd) for fd in fds)]


class DaemonProcess:
    def __init__(
        self,
        directory: Path | None,
        *,
        dram_size: str | None = "64M",
        nvme_size: str | None = "256M",
        extra_args: Sequence[str] = (),
        config_text: str | None = None,
        runtime: str = "asyncio",
        command_prefix: Sequence[str] = (),
        listening: socket.socket | None = None,
        manager: ServiceManager | None = None,
    ) -> None:
        """``directory=None`` runs the daemon on its embedded defaults (socket and data where
        :mod:`kvtierd.config` puts them); a ``None`` size leaves that default too.
        ``command_prefix`` goes before the command line, e.g. ``["ip", "netns", "exec", name]`` to
        run the daemon in a network namespace (its Unix socket is a file, so the caller still
        reaches it); the prefix must exec the daemon, so that the signals reach it.
        ``listening``: a listening Unix socket on the daemon's socket path, passed to every start
        as systemd's socket activation passes it (descriptor 3, ``LISTEN_FDS``,
        ``LISTEN_PID``): connections made while the daemon is stopped wait in it.
        ``manager``: systemd's notify socket and file-descriptor store
        (:class:`~kvtierd.testing.service.ServiceManager`): what it stores is passed to every
        start after the socket, named in ``LISTEN_FDNAMES``."""
        self.directory = directory if directory is not None else default_data_dir().parent
        self.socket = directory / "kvtierd.sock" if directory is not None else default_socket_path()
        self.data_dir = directory / "data" if directory is not None else default_data_dir()
        self.log_path = self.directory / "daemon.log"
        self.args = ["--runtime", runtime]
        if directory is not None:
            self.args += ["--socket", str(self.socket), "--data-dir", str(self.data_dir)]
        if dram_size is not None:
            self.args += ["--dram-size", dram_size]
        if nvme_size is not None:
            self.args += ["--nvme-size", nvme_size]
        self.args += list(extra_args)
        if config_text is not None:
            config = self.directory / "kvtierd.toml"
            self.directory.mkdir(parents=True, exist_ok=True)
            config.write_text(config_text)
            self.args += ["--config", str(config)]
        self.command_prefix = list(command_prefix)
        self.listening = listening
        self.manager = manager
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> DaemonProcess:
        self.directory.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        prefix, named = self.command_prefix, list[tuple[str, int]]()
        if self.listening is not None:
            named.append(("kvtierd.socket", self.listening.fileno()))
        if self.manager is not None:
            env.update(self.manager.environment())
            named += self.manager.stored()
        passed = tuple(fd for _, fd in named)
        if named:
            env.update(
                LISTEN_FDS=str(len(named)), LISTEN_FDNAMES=":".join(name for name, _ in named)
            )
            prefix = [*prefix, *activated_prefix(*passed)]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [*prefix, sys.executable, "-m", "kvtierd", *self.args],
                stdout=log,
                stderr=log,
                env=env,
                pass_fds=passed,
            )
        try:
            wait_until_serving(self.socket, self.process, self.log_path, timeout_s)
        except BaseException:  # it did not become ready, or answered oddly: do not leave it
            self.kill()
            raise
        return self

    def log(self) -> str:
        return _log(self.log_path)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        assert self.process is not None
        try:
            return terminate(self.process, timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.running:
            try:
                self.stop()
            finally:
                self.kill()


def free_port(host: str = "127.0.0.1", *, also_free: Sequence[int] = ()) -> int:
    """A TCP port that nobody listens on now (in this namespace), with ``port + offset`` free
    too for every offset in ``also_free`` (10000 for a cluster node's bus port)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host if _is_local(host) else "127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if all(port + offset < 65536 and _port_free(port + offset) for offset in also_free):
            return port
    raise RuntimeError("no free port found")


def _is_local(host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            return False
    return True


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True
