"""One NIXL agent: DRAM regions registered for a peer to pull, and pulls from a peer.

Theory of operation
-------------------
NIXL moves bytes between registered memory of two *agents* (one per process) over a backend;
here always UCX, which picks TCP, shared memory or RDMA by what the host has. The owner of the
bytes (the daemon, for its arena regions) registers each region once and hands a peer two
things out of band: its agent metadata (connection details and the remote keys of everything
registered, :meth:`NixlAgent.metadata`) and the extents it may read (:meth:`NixlAgent.descriptors`).
The puller loads the metadata (:meth:`NixlAgent.add_peer`) and posts a READ from those extents
into its own registered memory (:meth:`NixlAgent.pull`); the owner's CPU takes no part.

What this relies on, measured with ``nixl==1.5.1``:

* ``initialize_xfer`` checks both descriptor lists against what is registered (locally, and in
  the peer's metadata as loaded) and raises at once for an extent outside them; the transfer
  itself ends in ``DONE`` or ``ERR`` as ``check_xfer_state`` reports, and may stay ``PROC``
  forever if the peer stops answering, hence the deadline on every pull.
* NIXL's own descriptor serialisation is ``pickle``; a puller would run whatever its peer sent.
  :meth:`NixlAgent.descriptors` writes a plain msgpack list of ``(address, length)`` instead.
* A process that loaded NIXL segfaults while the interpreter shuts down, even after every
  agent was closed; such a process ends through :func:`exit_process`.

An agent is used from one thread (``NIXL_THREAD_SYNC_NONE``, NIXL's default without a listener
thread); UCX's progress thread runs inside NIXL.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import anyio
import msgspec

from kvtierd.errors import InvalidRequestError, StorageIOError

__all__ = ["Extent", "NixlAgent", "Registration", "TransferError", "exit_process"]

#: ``(address, length)`` of bytes in this process.
Extent = tuple[int, int]
#: The first and the longest sleep between two polls of a transfer's state.
_POLL_FIRST_S = 0.0001
_POLL_MAX_S = 0.005
_DRAM = "DRAM"


class TransferError(StorageIOError):
    """NIXL refused or failed a registration or a transfer, or a transfer missed its deadline
    (``EIO``)."""


class _RemoteExtents(msgspec.Struct, frozen=True, array_like=True):
    """What :meth:`NixlAgent.descriptors` sends: whose extents, and which."""

    agent: str
    extents: list[tuple[int, int]]


@dataclass(frozen=True, eq=False)
class Registration:
    """A DRAM range registered with an agent, until :meth:`NixlAgent.deregister`."""

    address: int
    nbytes: int
    descs: Any  # nixlRegDList


@contextlib.contextmanager
def _translated(step: str) -> Iterator[None]:
    """NIXL's exceptions (``nixlNotFoundError`` and kin, each a bare ``Exception``) as
    :class:`TransferError`; anything of ours passes through."""
    try:
        yield
    except TransferError:
        raise
    except Exception as exc:
        if not type(exc).__module__.startswith("nixl"):
            raise
        raise TransferError(f"NIXL {step}: {type(exc).__name__}: {exc}") from exc


class NixlAgent:
    """The owner of one ``nixl_agent`` with a UCX backend.

    ``name`` must be unique among the agents that meet (a peer is known by it).
    ``ucx_params`` are the UCX backend's initialisation parameters (``num_workers``,
    ``ucx_devices``, ``ucx_error_handling_mode``); transports are chosen by UCX's environment
    (``UCX_TLS``). Raises :class:`ImportError` when NIXL is not installed and
    :class:`TransferError` when the backend cannot start.
    """

    def __init__(self, name: str, *, ucx_params: Mapping[str, str] | None = None) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        with _translated("agent creation"):
            self._agent: Any = nixl_agent(name, nixl_agent_config(backends=[]))
            if "UCX" not in self._agent.get_plugin_list():
                raise TransferError("NIXL has no UCX plugin")
            self._agent.create_backend("UCX", dict(ucx_params or {}))
        self.name = name
        self._registrations: list[Registration] = []
        self._peers: set[str] = set()
        #: Transfers that could not be released (still running): kept so their memory is not
        #: freed under them.
        self._stuck: list[Any] = []
        self._closed = False

    def register(self, address: int, nbytes: int) -> Registration:
        """Register ``nbytes`` of DRAM at ``address`` for transfers; the memory must stay mapped
        until :meth:`deregister` or :meth:`close`."""
        self._check_open()
        if address <= 0 or nbytes <= 0:
            raise InvalidRequestError(f"cannot register {nbytes} bytes at {address:#x}")
        with _translated("register_memory"):
            descs = self._agent.register_memory([(address, nbytes, 0, "")], _DRAM)
        registration = Registration(address, nbytes, descs)
        self._registrations.append(registration)
        return registration

    def deregister(self, registration: Registration) -> None:
        """Withdraw ``registration``: peers can no longer read it (already loaded metadata
        still names it; their pulls fail)."""
        self._registrations.remove(registration)
        with _translated("deregister_memory"):
            self._agent.deregister_memory(registration.descs)

    def metadata(self) -> bytes:
        """This agent's metadata for a peer: how to reach it and what is registered now."""
        self._check_open()
        with _translated("get_agent_metadata"):
            return bytes(self._agent.get_agent_metadata())

    def descriptors(self, extents: Sequence[Extent]) -> bytes:
        """``extents`` of this agent's registered memory, serialised for a peer's :meth:`pull`."""
        if not extents or any(address <= 0 or length <= 0 for address, length in extents):
            raise InvalidRequestError(f"no valid extents to describe: {list(extents)[:4]}")
        return msgspec.msgpack.encode(_RemoteExtents(self.name, [tuple(e) for e in extents]))

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's :meth:`metadata` (again, to learn its new registrations); returns its
        name."""
        self._check_open()
        with _translated("add_remote_agent"):
            loaded = self._agent.add_remote_agent(metadata)
        peer = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._peers.add(peer)
        return peer

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer`` and disconnect from it."""
        self._peers.discard(peer)
        with _translated("remove_remote_agent"):
            self._agent.remove_remote_agent(peer)

    def pull(
        self, peer: str, remote: bytes, local: Sequence[Extent], *, timeout_s: float
    ) -> None:
        """Read the extents ``remote`` (from the peer's :meth:`descriptors`) into ``local``,
        registered here, pairwise, and wait for the transfer for at most ``timeout_s``.

        Raises :class:`~kvtierd.errors.InvalidRequestError` for descriptors that are not the
        peer's or do not pair with ``local``, and :class:`TransferError` when NIXL refuses or
        fails the transfer or it misses the deadline. ``local`` holds whatever arrived when it
        raises.
        """
        handle = self._start(peer, remote, local)
        deadline = time.monotonic() + timeout_s
        pause = _POLL_FIRST_S
        try:
            while not self._finished(handle):
                if time.monotonic() >= deadline:
                    raise TransferError(f"NIXL READ from {peer} not done in {timeout_s:g} s")
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
        finally:
            self._release(handle)

    async def pull_async(
        self, peer: str, remote: bytes, local: Sequence[Extent], *, timeout_s: float
    ) -> None:
        """:meth:`pull`, polling with ``anyio.sleep`` so the event loop runs meanwhile; a
        cancellation releases (aborts) the transfer too."""
        handle = self._start(peer, remote, local)
        pause = _POLL_FIRST_S
        try:
            with anyio.move_on_after(timeout_s) as scope:
                while not self._finished(handle):
                    await anyio.sleep(pause)
                    pause = min(2 * pause, _POLL_MAX_S)
            if scope.cancelled_caught:
                raise TransferError(f"NIXL READ from {peer} not done in {timeout_s:g} s")
        finally:
            self._release(handle)

    def close(self) -> None:
        """Deregister everything and forget every peer; idempotent. The process still ends
        through :func:`exit_process`."""
        if self._closed:
            return
        self._closed = True
        with _translated("close"):
            for peer in sorted(self._peers):
                self._agent.remove_remote_agent(peer)
            self._peers.clear()
            while self._registrations:
                self._agent.deregister_memory(self._registrations.pop().descs)

    def _start(self, peer: str, remote: bytes, local: Sequence[Extent]) -> Any:
        self._check_open()
        try:
            described = msgspec.msgpack.decode(remote, type=_RemoteExtents)
        except msgspec.DecodeError as exc:
            raise InvalidRequestError(f"not NIXL descriptors: {exc}") from exc
        if described.agent != peer:
            raise InvalidRequestError(f"descriptors of {described.agent!r}, not of {peer!r}")
        if [length for _, length in described.extents] != [length for _, length in local]:
            raise InvalidRequestError("remote and local extents differ in number or length")
        with _translated("initialize_xfer"):
            remote_descs = self._agent.get_xfer_descs(
                [(address, length, 0) for address, length in described.extents], _DRAM
            )
            local_descs = self._agent.get_xfer_descs(
                [(address, length, 0) for address, length in local], _DRAM
            )
            handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, peer)
        try:
            with _translated("transfer"):
                if self._agent.transfer(handle) == "ERR":
                    raise TransferError(f"NIXL READ from {peer} failed to post")
        except BaseException:
            self._release(handle)
            raise
        return handle

    def _finished(self, handle: Any) -> bool:
        with _translated("check_xfer_state"):
            state = self._agent.check_xfer_state(handle)
        if state == "ERR":
            raise TransferError("NIXL READ failed (check_xfer_state: ERR)")
        return state == "DONE"

    def _release(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception:  # still running and not cancellable: keep it from being freed
            self._stuck.append(handle)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"NIXL agent {self.name} is closed")


def exit_process(code: int = 0) -> NoReturn:
    """End a process that loaded NIXL: flush stdout and stderr, then ``os._exit(code)``.

    NIXL 1.5.1's native objects crash (SIGSEGV, exit status 139) in the interpreter's shutdown,
    after ``main`` returned, even when every agent was closed and deleted; a clean status
    would be lost and a core dumped. ``os._exit`` skips the shutdown (``atexit`` handlers and
    finalisers do not run), so flush and close what matters before calling it.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
