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
exactly two descriptors (its region's sealed memory file and one end of a control socket
pair), maps that region, registers it with an agent of its own and serves NIXL peers. What a
peer can reach here is this tenant's region and this process's own memory (an interpreter,
NIXL, UCX, and the metadata of the peer daemons it pulled from for this region): no other
tenant's byte, nothing of the daemon's. A peer that makes it fault ends this process only; the
daemon starts another.

The control socket (:mod:`kvtierd.nixl.control`): once ready, this process sends
:class:`~kvtierd.nixl.control.Ready` (its agent's name, where the region is mapped here, the
metadata of the region's registration), then serves :class:`~kvtierd.nixl.control.Stir` and
:class:`~kvtierd.nixl.control.Pull` until the daemon closes its end (or dies: the kernel closes
it then), and exits.

Progress. The agent has no progress thread (it would spin a core for the agent's life); the
pump drives UCX's progress every :data:`PUMP_INTERVAL_S` for :data:`LINGER_S` after each stir
or pull (the daemon stirs while a NIXL lease of this region is held), and sleeps otherwise. A
peer reading over TCP needs it; one over shared memory or RDMA does not.

Arguments: ``--region-fd N --control-fd N --size-bytes N --agent NAME --region ID --tenant T``
(the last two name it in ``ps`` and logs only). The process ends through
:func:`~kvtierd.nixl.agent.exit_process`, as every process that loaded NIXL must.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import mmap
import os
import resource
import signal
import socket
import sys
import time
from collections import OrderedDict

import anyio
import anyio.abc

from kvtierd.errors import InvalidRequestError, KvtierError, RemoteProtocolError, errno_of
from kvtierd.io.buffers import buffer_address
from kvtierd.nixl.agent import NixlAgent, Registration, exit_process
from kvtierd.nixl.control import FrameDecoder, Pull, Pulled, Ready, Stir, ToExporter, encode

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
        self, agent: NixlAgent, registration: Registration, stream: anyio.abc.SocketStream
    ) -> None:
        self.agent = agent
        self.registration = registration
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
        """Carry out ``request`` and answer it, with the error's errno when it fails."""
        reply = Pulled(request.id)
        try:
            base, size = self.registration.extent
            if request.offset < 0 or request.length <= 0 or request.offset + request.length > size:
                raise InvalidRequestError(
                    f"{request.length} bytes at offset {request.offset} leave the region"
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


def _map(fd: int, size_bytes: int) -> tuple[mmap.mmap, int]:
    """The region, mapped shared, **read-only** and populated (first touches would slow the
    first reads). Read-only because NIXL peers can write as well as read whatever this process
    registered (UCX refuses no remote WRITE): a write into a read-only page is refused by the
    kernel (``cma``) or faults this process (TCP: it is restarted), and never changes a byte of
    the tenant's blocks. Nothing in this process maps the region writable."""
    try:
        region = mmap.mmap(
            fd, size_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ
        )
    finally:
        os.close(fd)
    view = memoryview(region)
    try:
        return region, buffer_address(view)
    finally:
        view.release()


async def _serve(agent: NixlAgent, registration: Registration, control: socket.socket) -> None:
    stream = await anyio.abc.UNIXSocketStream.from_socket(control)
    async with stream:
        exporter = _Exporter(agent, registration, stream)
        metadata = agent.metadata(registration)
        address, size = registration.extent
        await exporter.send(Ready(agent.name, address, size, metadata))
        await exporter.serve()


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvtierd.nixl.exporter")
    for name in ("--region-fd", "--control-fd", "--size-bytes", "--region"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--agent", required=True)
    parser.add_argument("--tenant", required=True)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    """Export one region until the daemon closes the control socket; the exit status. The
    caller ends the process through :func:`~kvtierd.nixl.agent.exit_process`."""
    args = _arguments(argv)
    # A peer that makes this process fault is expected: no core file of a tenant's memory.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon ends it, not the terminal
    control = socket.socket(fileno=args.control_fd)
    region, address = _map(args.region_fd, args.size_bytes)
    agent = NixlAgent(args.agent, progress_thread=False)
    try:
        registration = agent.register(address, args.size_bytes)
        anyio.run(_serve, agent, registration, control)
    finally:
        agent.close()
        with contextlib.suppress(BufferError):
            region.close()
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
