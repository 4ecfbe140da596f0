"""One tenant region exported over NIXL by a process of its own (``python -m
kvtierd.nixl.exporter``), started and owned by the daemon (:mod:`kvtierd.nixl.exporters`).

Theory of operation
-------------------
NIXL over UCX checks no access on the owner's side: with TCP, UCX emulates a remote READ by
messages the owner answers with a ``memcpy`` from whatever address the peer named, and with
``cma`` the peer's kernel call reads the owner's memory directly. A peer's own NIXL checks its
descriptors against the metadata it loaded, which the peer can edit. So whatever memory the
process that runs the agent maps, a NIXL peer of that process can read, and an address it does
not map kills it (SIGSEGV). The bound therefore has to be the process: this one is started
fresh by ``exec`` (never a fork of the daemon, which would inherit the whole arena), inherits
exactly three descriptors (its region's sealed memory file, a small landing memory file for
peer-restore pulls, and one end of a control socket pair) besides stdin (``/dev/null``), stdout
(``/dev/null``: NIXL's INFO lines) and stderr (a pipe the daemon relays to its log), and closes
any other it finds. It maps the region **read-only** (NIXL peers can WRITE whatever is
registered: UCX refuses no remote write; a write to a read-only page is refused by the kernel
or faults this process, and never changes a byte of the tenant's), registers it with an agent
of its own and serves NIXL peers. What a peer can reach here is this tenant's region (to read)
and this process's own memory (an interpreter, NIXL, UCX, the landing buffer, and the metadata
of the peer daemons it pulled from for this region): no other tenant's byte, nothing of the
daemon's. A peer that makes it fault ends this process only; the daemon starts another.

Privileges (:func:`_confine`): started as root, it drops to ``--user`` (``nixl.exporter_user``,
``nobody`` by default: ``setgroups([])``, ``setgid``, ``setuid``) after its agent is made and its
memory registered and before it tells the daemon it is ready, so no NIXL peer is ever served by
a privileged process (NIXL is loaded, and UCX's transports opened, before the drop because the
interpreter's and NIXL's files need not be readable by that user: under ``/root`` here). In
every case it sets ``PR_SET_NO_NEW_PRIVS`` and ``PR_SET_DUMPABLE`` 0 (no core file of a
tenant's memory, and ``/proc/PID/mem`` is the kernel's to guard, not the uid's).

The control socket (:mod:`kvtierd.nixl.control`): once ready, this process sends
:class:`~kvtierd.nixl.control.Ready` (its agent's name, where the region is mapped here, the
metadata of the region's registration), then serves :class:`~kvtierd.nixl.control.Stir` and
:class:`~kvtierd.nixl.control.Pull` until the daemon closes its end (or dies: the kernel closes
it then), and exits. A pull (a peer restore) fills part of the **landing buffer**, never the
region: the daemon copies it into the arena slot and checks the copy against its manifest's
checksum (a NIXL peer can write the landing buffer too: only the copy is trusted).

Progress. The agent has no progress thread (it would spin a core for the agent's life); the
pump drives UCX's progress every :data:`PUMP_INTERVAL_S` for :data:`LINGER_S` after each stir
or pull (the daemon stirs while a NIXL lease of this region is held), and sleeps otherwise. A
peer reading over TCP needs it; one over shared memory or RDMA does not.

Arguments: ``--region-fd N --landing-fd N --control-fd N --size-bytes N --landing-bytes N
--agent NAME --user USER --region ID --tenant T`` (the last two name it in ``ps`` and logs
only; ``--user ""`` keeps the uid). The process ends through
:func:`~kvtierd.nixl.agent.exit_process`, as every process that loaded NIXL must.
"""

from __future__ import annotations

import ctypes
import os

#: ``prctl`` options (``<linux/prctl.h>``).
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0),
                  ctypes.c_ulong(0)) != 0:  # fmt: skip
        error = ctypes.get_errno()
        raise OSError(error, f"prctl({option}, {value}): {os.strerror(error)}")


if __name__ == "__main__":
    # First of all: no_new_privs holds per thread and is inherited only by threads made after
    # it, and the imports below start threads (numpy's OpenBLAS does, at import).
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import mmap  # noqa: E402
import pwd  # noqa: E402
import resource  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import OrderedDict  # noqa: E402

import anyio  # noqa: E402
import anyio.abc  # noqa: E402

from kvtierd.errors import InvalidRequestError, KvtierError, RemoteProtocolError, errno_of  # noqa: E402
from kvtierd.io.buffers import buffer_address  # noqa: E402
from kvtierd.nixl.agent import NixlAgent, Registration, exit_process  # noqa: E402
from kvtierd.nixl.control import FrameDecoder, Pull, Pulled, Ready, Stir, ToExporter, encode  # noqa: E402

__all__ = ["LINGER_S", "PUMP_INTERVAL_S", "main"]

log = logging.getLogger("kvtierd.nixl.exporter")

#: How often UCX's progress is driven while peers may be reading. Not below 1 ms: uvloop
#: rounds a shorter timer down to 0, and the pump would then spin.
PUMP_INTERVAL_S = 0.001
#: How long progress goes on after the last stir or pull: a pull set up late (a client that
#: connects, then leases) or the last completions of a released lease still progress.
LINGER_S = 5.0
#: Peer agents (of peer daemons, for restores) kept loaded; the least recently used beyond it
#: are forgotten.
MAX_PEERS = 16
_RECEIVE_BYTES = 1 << 16


class _Exporter:
    """The region's agent, driven from the control socket."""

    def __init__(
        self,
        agent: NixlAgent,
        registration: Registration,
        landing: Registration,
        stream: anyio.abc.SocketStream,
    ) -> None:
        self.agent = agent
        self.registration = registration
        self.landing = landing
        self.stream = stream
        self._send_lock = anyio.Lock()
        self._linger_until = 0.0
        self._wake = anyio.Event()
        #: Peer agent name -> its metadata as loaded, least recently used first.
        self._peers: OrderedDict[str, bytes] = OrderedDict()
        self._pulling: dict[str, int] = {}

    async def send(self, message: Ready | Pulled) -> None:
        async with self._send_lock:
            await self.stream.send(encode(message))

    def stir(self) -> None:
        self._linger_until = time.monotonic() + LINGER_S
        self._wake.set()

    async def pump(self) -> None:
        """Drive the agent's progress while stirred, idle otherwise; runs until cancelled."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while time.monotonic() < self._linger_until:
                self.agent.progress()
                await anyio.sleep(PUMP_INTERVAL_S)

    async def serve(self) -> None:
        """Answer the daemon's messages until it closes the socket."""
        decoder: FrameDecoder[ToExporter] = FrameDecoder(ToExporter)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self.pump)
            while True:
                try:
                    data = await self.stream.receive(_RECEIVE_BYTES)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
                for message in decoder.feed(data):
                    self.stir()
                    if isinstance(message, Pull):
                        tasks.start_soon(self.pull, message)
                    elif not isinstance(message, Stir):
                        raise RemoteProtocolError(f"unexpected {type(message).__name__}")
            tasks.cancel_scope.cancel()

    async def pull(self, request: Pull) -> None:
        """Carry out ``request`` (into the landing buffer, never the region, which is mapped
        read-only) and answer it, with the error's errno when it fails."""
        reply = Pulled(request.id)
        try:
            base, size = self.landing.extent
            if request.offset < 0 or request.length <= 0 or request.offset + request.length > size:
                raise InvalidRequestError(
                    f"{request.length} bytes at offset {request.offset} leave the landing buffer"
                )
            peer = self._load(request.agent, request.metadata)
            self._pulling[peer] = self._pulling.get(peer, 0) + 1
            try:
                local = [(base + request.offset, request.length)]
                await self.agent.pull_async(
                    peer, request.descriptors, local, timeout_s=request.timeout_s
                )
            finally:
                self._pulling[peer] -= 1
        except KvtierError as exc:
            reply = Pulled(request.id, errno_of(exc), str(exc))
        self.stir()
        await self.send(reply)

    def _load(self, name: str, metadata: bytes) -> str:
        """The peer agent ``name`` loaded from ``metadata`` (again if it changed), forgetting
        the least recently used idle peers beyond :data:`MAX_PEERS`."""
        known = self._peers.get(name)
        if known == metadata:
            self._peers.move_to_end(name)
            return name
        if known is not None:
            self.agent.remove_peer(name)
            del self._peers[name]
        loaded = self.agent.add_peer(metadata)
        if loaded != name:
            self.agent.remove_peer(loaded)
            raise InvalidRequestError(f"the metadata names agent {loaded!r}, not {name!r}")
        self._peers[name] = metadata
        for old in list(self._peers):
            if len(self._peers) <= MAX_PEERS:
                break
            if old != name and not self._pulling.get(old):
                self.agent.remove_peer(old)
                del self._peers[old]
        return name


def _map_landing(fd: int, size_bytes: int) -> tuple[mmap.mmap, int]:
    """The landing buffer (the daemon's memory file, sealed against resizing): mapped shared
    and writable, the only writable mapping of a file the daemon shares here."""
    return _map_fd(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def _close_other_fds(keep: set[int]) -> None:
    """Close every descriptor but ``keep`` (and stdin, stdout, stderr): whatever the daemon's
    process had open that ``exec`` let through (its log file, for one) is no business of a
    process whose memory NIXL peers can reach."""
    keep = keep | {0, 1, 2}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
                os.close(fd)


def _confine(user: str) -> None:
    """Drop to ``user`` when running as root (``setgroups([])``, ``setgid``, ``setuid``, and
    checked: no way back to uid 0; every thread, as glibc applies them to all), then, in every
    case, not dumpable (and no new privileges: set again for this thread; run as a program, the
    module set it before any import could start a thread, as it holds per thread)."""
    if user and os.geteuid() == 0:
        entry = pwd.getpwnam(user)
        if entry.pw_uid == 0:
            raise PermissionError(f"nixl.exporter_user {user!r} is root")
        os.setgroups([])
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)
        with contextlib.suppress(PermissionError):
            os.setuid(0)
        if os.geteuid() == 0 or os.getuid() == 0:
            raise PermissionError(f"still root after dropping to {user!r}")
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    forbid_dumps()


def forbid_dumps() -> None:
    """``PR_SET_DUMPABLE`` 0 for this process: no core file, and no process of its uid but root
    may ptrace it or open its ``/proc/PID/mem``. The daemon calls it for itself where its
    exporters keep its uid (a non-root daemon), so that an exporter taken over through its
    NIXL peers cannot read the daemon's memory (``docs/nixl.md``)."""
    _prctl(_PR_SET_DUMPABLE, 0)


def _map(fd: int, size_bytes: int) -> tuple[mmap.mmap, int]:
    """The region, mapped shared, **read-only** and populated (first touches would slow the
    first reads). Read-only because NIXL peers can write as well as read whatever this process
    registered (UCX refuses no remote WRITE): a write into a read-only page is refused by the
    kernel (``cma``) or faults this process (TCP: it is restarted), and never changes a byte of
    the tenant's blocks. Nothing in this process maps the region writable."""
    return _map_fd(fd, size_bytes, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)


def _map_fd(fd: int, size_bytes: int, flags: int, prot: int) -> tuple[mmap.mmap, int]:
    """``fd`` mapped with ``flags`` and ``prot``, then closed (the mapping keeps the file); the
    mapping and its address."""
    try:
        mapped = mmap.mmap(fd, size_bytes, flags=flags, prot=prot)
    finally:
        os.close(fd)
    view = memoryview(mapped)
    try:
        return mapped, buffer_address(view)
    finally:
        view.release()


async def _serve(
    agent: NixlAgent, registration: Registration, landing: Registration, control: socket.socket
) -> None:
    stream = await anyio.abc.UNIXSocketStream.from_socket(control)
    async with stream:
        exporter = _Exporter(agent, registration, landing, stream)
        metadata = agent.metadata(registration)
        address, size = registration.extent
        await exporter.send(Ready(agent.name, address, size, metadata))
        await exporter.serve()


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvtierd.nixl.exporter")
    for name in ("--region-fd", "--landing-fd", "--control-fd", "--size-bytes",
                 "--landing-bytes", "--region"):  # fmt: skip
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--agent", required=True)
    parser.add_argument("--user", default="nobody")
    parser.add_argument("--tenant", required=True)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    """Export one region until the daemon closes the control socket; the exit status. The
    caller ends the process through :func:`~kvtierd.nixl.agent.exit_process`."""
    args = _arguments(argv)
    # A peer that makes this process fault is expected: no core file of a tenant's memory.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon ends it, not the terminal
    _close_other_fds({args.region_fd, args.landing_fd, args.control_fd})
    control = socket.socket(fileno=args.control_fd)
    region, address = _map(args.region_fd, args.size_bytes)
    landing, landing_address = _map_landing(args.landing_fd, args.landing_bytes)
    # The interpreter's and NIXL's files need not be readable by the user dropped to: load
    # what serving needs first. No peer can reach this process before Ready is sent.
    import anyio._backends._asyncio
    import nixl._api  # noqa: F401

    agent = NixlAgent(args.agent, progress_thread=False)
    try:
        registration = agent.register(address, args.size_bytes)
        landing_registration = agent.register(landing_address, args.landing_bytes)
        _confine(args.user)
        anyio.run(_serve, agent, registration, landing_registration, control)
    finally:
        agent.close()
        for mapping in (region, landing):
            with contextlib.suppress(BufferError):
                mapping.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format="kvtierd.nixl.exporter[%(process)d]: %(message)s")  # fmt: skip
    try:
        status = main(sys.argv[1:])
    except BaseException as exc:
        log.error("the NIXL exporter failed: %s: %s", type(exc).__name__, exc)
        status = 1
    exit_process(status)
