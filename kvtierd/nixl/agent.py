"""One NIXL agent: DRAM regions registered for a peer to pull, and pulls from a peer.

Theory of operation
-------------------
NIXL moves bytes between registered memory of two *agents* (one per process) over a backend;
here always UCX, which picks TCP, shared memory or RDMA by what the host has. The owner of the
bytes (for the daemon's arena, one exporter process per tenant region,
:mod:`kvtierd.nixl.exporter`) registers its region once and hands a peer two
things out of band: agent metadata (how to reach it and the remote keys of what is registered,
:meth:`NixlAgent.metadata`, all of it or one registration's) and the extents it may read
(:meth:`NixlAgent.descriptors`, :mod:`kvtierd.nixl.descriptors`). The puller loads the metadata
(:meth:`NixlAgent.add_peer`) and posts a READ from those extents into its own registered memory
(:meth:`NixlAgent.pull`, :meth:`NixlAgent.pull_async`); the owner's CPU takes no part.

What this relies on, measured with ``nixl==1.5.1`` over UCX/TCP, and what it does not:

* A transfer ends in ``DONE`` or ``ERR`` as ``check_xfer_state`` reports, or stays ``PROC``
  forever if the peer stops answering: every pull has a deadline.
* NIXL is **not** an access check. Deregistering memory does not revoke a peer that loaded the
  metadata (its READs of the old extents still succeed), and the only check of an extent is
  the puller's own, against metadata the puller can edit: over UCX the owner serves a READ of
  any address of its process (and dies of one it does not map). Who may read what is kvtierd's
  business: whatever a process with an agent maps is readable by its peers, so the daemon's
  regions are exported each by a process that maps that region alone; a client gets extents
  only with a lease and re-checks the bytes after the transfer.
* NIXL raises exceptions with no common base (``nixlNotFoundError`` and eleven more, each a bare
  ``Exception``, plus ``RuntimeError``, ``ValueError`` and ``TypeError`` from its Python layer).
  :func:`nixl_errors` turns them into :class:`TransferError`, in this one place.
* A process that loaded NIXL segfaults while the interpreter shuts down, even after every agent
  was closed; such a process ends through :func:`exit_process`. Nothing here imports NIXL until
  an agent is made, and a process that cannot be lost makes one only through
  :func:`start_agent`, after :func:`kvtierd.nixl.probe.probe_nixl` proved NIXL in a child.

An agent is used from one thread (``NIXL_THREAD_SYNC_NONE``, NIXL's default without a listener
thread); UCX's progress runs inside NIXL's calls. Setting a transfer up (``initialize_xfer``, and
the connection on a first pull from a peer) is a blocking call of a few milliseconds, also in
:meth:`NixlAgent.pull_async`; only the wait for completion yields to the event loop.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from kvtierd.errors import InvalidRequestError, KvtierError, StorageIOError
from kvtierd.nixl import descriptors
from kvtierd.nixl.descriptors import Extent

if TYPE_CHECKING:
    from kvtierd.nixl.probe import NixlVerdict

__all__ = [
    "Extent",
    "NixlAgent",
    "Registration",
    "TransferError",
    "exit_process",
    "nixl_errors",
    "nixl_loaded",
    "start_agent",
]

#: The first and the longest sleep between two polls of a transfer's state. An agent without a
#: progress thread moves its data only when polled, so the back-off stays short (a pull is
#: work in progress; the async pull's sleeps are timers, which uvloop keeps at 1 ms or more).
POLL_FIRST_S = 0.0001
POLL_MAX_S = 0.0005
_DRAM = "DRAM"
#: What NIXL's Python layer raises for a bad argument or a missing plug-in.
_NIXL_PYTHON_ERRORS = (RuntimeError, ValueError, TypeError)


class TransferError(StorageIOError):
    """NIXL refused or failed an agent, a registration or a transfer, or a transfer missed its
    deadline (``EIO``). ``nixl_error`` names NIXL's exception ("" when NIXL raised none)."""

    def __init__(self, message: str, *, nixl_error: str = "") -> None:
        super().__init__(message)
        self.nixl_error = nixl_error


@contextlib.contextmanager
def nixl_errors(step: str) -> Iterator[None]:
    """Run NIXL calls (``step`` names them) with NIXL's exceptions raised as
    :class:`TransferError`; kvtierd's own errors pass through. Wrap only NIXL calls in it: a
    ``TypeError`` inside counts as NIXL's."""
    try:
        yield
    except KvtierError:
        raise
    except Exception as exc:
        name = type(exc).__name__
        if not (type(exc).__module__.startswith("nixl") or isinstance(exc, _NIXL_PYTHON_ERRORS)):
            raise
        raise TransferError(f"NIXL {step}: {name}: {exc}", nixl_error=name) from exc


@dataclass(frozen=True, eq=False)
class Registration:
    """A DRAM range registered with an agent, until :meth:`NixlAgent.deregister`."""

    address: int
    nbytes: int
    descs: Any  # nixlRegDList

    @property
    def extent(self) -> Extent:
        return (self.address, self.nbytes)


class NixlAgent:
    """The owner of one ``nixl_agent`` with a UCX backend; closed by :meth:`close` (or ``with``).

    ``name`` must be unique among the agents that meet (a peer is known by it).
    ``progress_thread``: NIXL's progress thread, which drives UCX for transfers this agent is
    the target of (a peer reading its memory over TCP needs it), and spins a core doing so,
    idle or not; without it the owner calls :meth:`progress` while peers may read.
    ``ucx_params`` are the UCX backend's initialisation parameters (``num_workers``,
    ``ucx_devices``, ``ucx_error_handling_mode``); transports are chosen by UCX's environment
    (``UCX_TLS``). This loads NIXL: in a process that cannot be lost use :func:`start_agent`.
    Raises :class:`ImportError` when NIXL is not installed and :class:`TransferError` when the
    backend cannot start.
    """

    def __init__(
        self,
        name: str,
        *,
        ucx_params: Mapping[str, str] | None = None,
        progress_thread: bool = True,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        with nixl_errors("agent creation"):
            self._agent: Any = nixl_agent(name, config)
            if "UCX" not in self._agent.get_plugin_list():
                raise TransferError("NIXL has no UCX plug-in")
            self._agent.create_backend("UCX", dict(ucx_params or {}))
        self.name = name
        self._registrations: list[Registration] = []
        self._peers: set[str] = set()
        #: Transfers NIXL could not abort when released: kept referenced, never freed under it.
        self._stuck: list[Any] = []
        self._closed = False

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def register(self, address: int, nbytes: int) -> Registration:
        """Register ``nbytes`` of DRAM at ``address`` for transfers; the memory must stay mapped
        until :meth:`deregister` or :meth:`close`."""
        self._check_open()
        if address <= 0 or nbytes <= 0:
            raise InvalidRequestError(f"cannot register {nbytes} bytes at {address:#x}")
        with nixl_errors("register_memory"):
            descs = self._agent.register_memory([(address, nbytes, 0, "")], _DRAM)
        registration = Registration(address, nbytes, descs)
        self._registrations.append(registration)
        return registration

    def deregister(self, registration: Registration) -> None:
        """Stop describing ``registration`` and withdraw it from NIXL. This does not revoke a
        peer that loaded metadata naming it: its pulls may still succeed (module docstring)."""
        self._check_open()
        self._registrations.remove(registration)
        with nixl_errors("deregister_memory"):
            self._agent.deregister_memory(registration.descs)

    def progress(self) -> None:
        """Let UCX make progress on this agent's transfers once (what its progress thread does
        in a loop; an agent made without one must be driven so while peers read from it)."""
        self._check_open()
        with nixl_errors("progress"):
            self._agent.get_new_notifs()

    def metadata(self, registration: Registration | None = None) -> bytes:
        """Metadata for a peer: how to reach this agent and the keys of what is registered, or
        of ``registration`` alone (what a tenant's client gets)."""
        self._check_open()
        with nixl_errors("get_agent_metadata"):
            if registration is None:
                return bytes(self._agent.get_agent_metadata())
            self._check_registered(registration)
            return bytes(
                self._agent.get_partial_agent_metadata(registration.descs, inc_conn_info=True)
            )

    def descriptors(
        self, extents: Sequence[Extent], *, within: Registration | None = None
    ) -> bytes:
        """``extents`` of this agent's registered memory (of ``within`` alone, when given),
        serialised for a peer's :meth:`pull`. Raises
        :class:`~kvtierd.errors.InvalidRequestError` for an extent outside it."""
        self._check_open()
        if within is not None:
            self._check_registered(within)
        ranges = [within.extent] if within else [r.extent for r in self._registrations]
        return descriptors.encode(self.name, extents, ranges)

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's :meth:`metadata` (again, to learn its new registrations); returns its
        name."""
        self._check_open()
        with nixl_errors("add_remote_agent"):
            loaded = self._agent.add_remote_agent(metadata)
        peer = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._peers.add(peer)
        return peer

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer`` and disconnect from it; a peer not loaded is ignored."""
        self._check_open()
        if peer not in self._peers:
            return
        self._peers.discard(peer)
        with nixl_errors("remove_remote_agent"):
            self._agent.remove_remote_agent(peer)

    def pull(self, peer: str, remote: bytes, local: Sequence[Extent], *, timeout_s: float) -> None:
        """Read the extents ``remote`` (from the peer's :meth:`descriptors`) into ``local``,
        registered here, pairwise, and wait for the transfer for at most ``timeout_s``.

        Raises :class:`~kvtierd.errors.InvalidRequestError` for descriptors that are not the
        peer's or do not pair with ``local``, or ``local`` extents not registered here, and
        :class:`TransferError` when NIXL refuses or fails the transfer or it misses the
        deadline. ``local`` holds whatever arrived when it raises. Success says the bytes
        arrived, not that they are still the ones the peer meant: check the lease after it.
        """
        handle = self._start(peer, remote, local)
        deadline = time.monotonic() + timeout_s
        pause = POLL_FIRST_S
        try:
            while not self._finished(handle):
                if time.monotonic() >= deadline:
                    raise TransferError(f"NIXL READ from {peer} not done in {timeout_s:g} s")
                time.sleep(pause)
                pause = min(2 * pause, POLL_MAX_S)
        finally:
            self._release(handle)

    async def pull_async(
        self, peer: str, remote: bytes, local: Sequence[Extent], *, timeout_s: float
    ) -> None:
        """:meth:`pull`, waiting with ``anyio.sleep`` between polls so the event loop runs
        meanwhile. A cancellation releases (aborts) the transfer; if NIXL cannot abort it, it
        may still write into ``local`` until :meth:`close`."""
        handle = self._start(peer, remote, local)
        pause = POLL_FIRST_S
        try:
            with anyio.move_on_after(timeout_s) as scope:
                while not self._finished(handle):
                    await anyio.sleep(pause)
                    pause = min(2 * pause, POLL_MAX_S)
            if scope.cancelled_caught:
                raise TransferError(f"NIXL READ from {peer} not done in {timeout_s:g} s")
        finally:
            self._release(handle)

    def close(self) -> None:
        """Forget every peer and deregister everything; idempotent. The process still ends
        through :func:`exit_process`."""
        if self._closed:
            return
        self._closed = True
        with nixl_errors("close"):
            for peer in sorted(self._peers):
                self._agent.remove_remote_agent(peer)
            self._peers.clear()
            while self._registrations:
                self._agent.deregister_memory(self._registrations.pop().descs)

    def _start(self, peer: str, remote: bytes, local: Sequence[Extent]) -> Any:
        self._check_open()
        described = descriptors.decode(remote, peer=peer, local=local)
        descriptors.check_within(local, [r.extent for r in self._registrations], what="local")
        with nixl_errors("initialize_xfer"):
            remote_descs = self._agent.get_xfer_descs(
                [(address, length, 0) for address, length in described.extents], _DRAM
            )
            local_descs = self._agent.get_xfer_descs(
                [(address, length, 0) for address, length in local], _DRAM
            )
            handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, peer)
        try:
            with nixl_errors("transfer"):
                if self._agent.transfer(handle) == "ERR":
                    raise TransferError(f"NIXL READ from {peer} failed to post")
        except BaseException:
            self._release(handle)
            raise
        return handle

    def _finished(self, handle: Any) -> bool:
        with nixl_errors("check_xfer_state"):
            state: str = self._agent.check_xfer_state(handle)
        if state == "ERR":
            raise TransferError("NIXL READ failed (check_xfer_state: ERR)")
        return state == "DONE"

    def _release(self, handle: Any) -> None:
        try:
            handle.release()
        except Exception:  # still running and not abortable: keep it from being freed
            self._stuck.append(handle)

    def _check_registered(self, registration: Registration) -> None:
        if registration not in self._registrations:
            where = f"{registration.nbytes} bytes at {registration.address:#x}"
            raise InvalidRequestError(f"{where} are not registered with {self.name}")

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"NIXL agent {self.name} is closed")


def start_agent(
    name: str,
    verdict: NixlVerdict,
    *,
    ucx_params: Mapping[str, str] | None = None,
    progress_thread: bool = True,
) -> NixlAgent:
    """A :class:`NixlAgent`, made only when ``verdict`` (of :func:`~kvtierd.nixl.probe.probe_nixl`
    in this environment) is ``ok``; :class:`TransferError` saying why not otherwise, without
    loading NIXL. The way a daemon or a client library makes its agent."""
    if not verdict.ok:
        raise TransferError(f"NIXL is not usable here: {verdict.detail}")
    return NixlAgent(name, ucx_params=ucx_params, progress_thread=progress_thread)


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


def nixl_loaded() -> bool:
    """Whether this process imported NIXL (and so must end through :func:`exit_process`)."""
    return any(name == "nixl" or name.startswith(("nixl.", "nixl_")) for name in sys.modules)
