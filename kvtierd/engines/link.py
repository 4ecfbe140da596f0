"""The one way an engine adapter reaches the daemon: an :class:`EngineLink`.

Every adapter (vLLM's connector and its offloading tier, SGLang's HiCache storage, LMCache's
backend) holds a link instead of a client of its own, so that what a lost connection is, what
is retried and what is a miss is decided once:

- A :class:`Session` is one blocking client and the namespaces opened on it, each opened once
  (by its :class:`NamespaceSpec`), and each tenant region as one ``uint8`` tensor, registered
  as pinned host memory for a CUDA device (:class:`~kvtierd.client.cuda.PinnedRegion`).
- The link opens a session on first use, and again once the connection is lost: the session a
  call finds no longer connected (a ``poll``, no round trip) is dropped before the call, and
  one a call loses (:func:`~kvtierd.errors.is_connection_loss`) after it. Connecting is one
  attempt with the adapter's timeout, never a wait: an engine's prefetch or scheduler thread
  must not sleep for seconds on a daemon that is away. After a failed attempt the next is not
  made before the client's back-off (:class:`~kvtierd.client.Reconnect`'s: doubling from 50 ms
  to 1 s, with jitter, so a host's engines do not all knock at once while the daemon starts);
  calls meanwhile answer their miss at once, for as long as the daemon is away.
- :meth:`EngineLink.call` runs a call on the session, once more on a new session when the
  connection was lost under it, and answers ``miss`` when the daemon cannot serve it: a
  refusal (no space, quota, a bad request) leaves the session as it is, and each failure is
  logged, an outage once until the daemon is back.
- :meth:`Session.with_room` is the one "make room and retry": a write refused for space
  (``NoSpaceError``: every free slot is leased or waits for write-back) waits for FSYNC, after
  which the written blocks are clean and evictable, and is tried once more.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from kvtierd.client import Client, Namespace, Reconnect, connect
from kvtierd.client.base import broken_error
from kvtierd.errors import (
    ClosedError,
    DaemonNotRunningError,
    InvalidRequestError,
    KvtierError,
    NoSpaceError,
    is_connection_loss,
)
from kvtierd.protocol.messages import Layout

if TYPE_CHECKING:  # torch is imported by the first arena (lmcache_keys needs no torch)
    import torch

    from kvtierd.client.cuda import PinnedRegion

__all__ = ["EngineLink", "NamespaceSpec", "Session"]

T = TypeVar("T")
#: The client's back-off between an engine's attempts to reach a daemon that is away, at most
#: a second (and its jitter) apart: a restarted daemon is found that soon after it serves.
_BACKOFF = Reconnect(max_backoff_s=1.0)


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """What an adapter opens a namespace with (its tenant is the link's)."""

    name: str
    block_bytes: int | None = None
    layout: Layout | None = None
    rank: int = 0
    world_size: int = 1


class Session:
    """One connection to the daemon, the namespaces opened on it and its regions' tensors;
    dropped whole when the connection is lost."""

    def __init__(self, client: Client, tenant: str) -> None:
        self.client = client
        self._tenant = tenant
        self._namespaces: dict[Hashable, Namespace] = {}
        self._arenas: dict[int, torch.Tensor] = {}
        #: Regions pinned for a CUDA device: registered, or ``None`` where CUDA refused (used
        #: unpinned, never tried again).
        self._pinned: dict[int, PinnedRegion | None] = {}
        #: Held while a namespace is opened or a region mapped, so each happens once; never
        #: taken by a thread inside a request.
        self._opening = threading.Lock()

    def namespace(self, spec: NamespaceSpec) -> Namespace:
        """The namespace ``spec`` names, opened the first time."""
        return self.namespace_as(spec, lambda: spec)

    def namespace_as(self, ident: Hashable, make_spec: Callable[[], NamespaceSpec]) -> Namespace:
        """The namespace known as ``ident`` (the adapter's own key, cheaper to make than the
        spec), opened with ``make_spec()`` the first time."""
        ns = self._namespaces.get(ident)
        if ns is not None:
            return ns
        with self._opening:
            ns = self._namespaces.get(ident)
            if ns is None:
                spec = make_spec()
                ns = self.client.namespace(
                    spec.name,
                    block_bytes=spec.block_bytes,
                    layout=spec.layout,
                    rank=spec.rank,
                    world_size=spec.world_size,
                    tenant=self._tenant,
                )
                self._namespaces[ident] = ns
            return ns

    def opened(self, ident: Hashable) -> Namespace | None:
        """The namespace opened as ``ident``, if it was."""
        return self._namespaces.get(ident)

    def namespaces(self) -> list[Namespace]:
        with self._opening:
            return list(self._namespaces.values())

    def arena(self, ns: Namespace, device: torch.device | None = None) -> torch.Tensor:
        """``ns``'s tenant region as one ``uint8`` tensor, read through lease extents (it keeps
        the mapping alive after the session closes). For a CUDA ``device`` (where the KV cache
        lives) the mapping is also registered as pinned host memory, once per region, so
        ``non_blocking`` copies into the cache are DMA instead of staged through a bounce
        buffer."""
        import torch

        from kvtierd.client.cuda import PinnedRegion

        region = ns.handle.region
        arena = self._arenas.get(region)
        if arena is not None and (device is None or region in self._pinned):
            return arena
        with self._opening:
            arena = self._arenas.get(region)
            if arena is None:
                with warnings.catch_warnings():  # read-only here: only read through it
                    warnings.filterwarnings("ignore", message=".*not writable.*")
                    arena = torch.frombuffer(ns.arena_buffer(), dtype=torch.uint8)
                self._arenas[region] = arena
            if device is not None and region not in self._pinned:
                self._pinned[region] = _pinned(region, PinnedRegion(arena, device))
        return arena

    def with_room(self, call: Callable[[], T]) -> T:
        """``call()``; refused for space, once more after FSYNC made the written blocks clean
        (and so evictable). A daemon without an NVMe tier has nothing to wait for."""
        try:
            return call()
        except NoSpaceError:
            with contextlib.suppress(InvalidRequestError):
                self.client.fsync()
            return call()

    def connected(self) -> bool:
        return self.client.connected()

    def close(self) -> None:
        """Close the connection (after the call in progress), then unpin the regions: the
        adapter drops a session only once its copies out of them are done."""
        with contextlib.suppress(KvtierError, OSError):
            self.client.close()
        with self._opening:
            pinned, self._pinned = list(self._pinned.values()), {}
            self._arenas.clear()
        for region in pinned:
            if region is not None:
                with contextlib.suppress(KvtierError):
                    region.unpin()


class EngineLink:
    """An adapter's sessions, opened on first use and after a lost connection (see the
    module). Thread-safe: the adapter's threads share the session."""

    def __init__(
        self,
        socket_path: str | None,
        *,
        client_name: str,
        tenant: str = "default",
        timeout_s: float | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self._socket = socket_path
        self._client_name = client_name
        self.tenant = tenant
        self._timeout_s = timeout_s
        self._log = log or logging.getLogger("kvtierd.engines")
        #: Guards the fields below; held across no request but a connection's INIT.
        self._lock = threading.Lock()
        self._session: Session | None = None
        self._closed = False
        #: Whether the daemon was found unreachable, and not reached since (said once).
        self._down = False
        #: Sessions opened (the first, then one per reconnect).
        self.opens = 0
        #: Connections tried, and the failed ones in a row; no new try before ``_retry_at``.
        self.attempts = 0
        self._failed = 0
        self._retry_at = 0.0
        #: Calls that answered a miss because the daemon could not serve them.
        self.failures = 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._session else "idle"
        return f"<EngineLink {self._client_name!r} {state}, {self.opens} opened>"

    def session(self) -> Session:
        """The open session, connecting if there is none or its connection is gone; raises
        what stops it (``ClosedError`` after :meth:`close`)."""
        with self._lock:
            if self._closed:
                raise ClosedError("the engine's link to kvtierd is closed")
            session = self._session
            if session is not None and not session.connected():
                self._session = None
                session.close()
                session = None
            if session is None:
                if time.monotonic() < self._retry_at:
                    raise DaemonNotRunningError(
                        f"kvtierd unreachable; the next attempt in "
                        f"{self._retry_at - time.monotonic():.2f} s"
                    )
                self.attempts += 1
                try:
                    client = connect(
                        self._socket, client_name=self._client_name, timeout_s=self._timeout_s
                    )
                except KvtierError as exc:
                    self._went_down(exc)
                    raise
                except OSError as exc:  # reset during the handshake, EMFILE: not the engine's
                    self._went_down(exc)
                    raise broken_error(exc) from exc
                self._failed, self._retry_at = 0, 0.0
                session = self._session = Session(client, self.tenant)
                self.opens += 1
                if self._down:
                    self._log.warning("kvtierd is reachable again")
                    self._down = False
            return session

    def current(self) -> Session | None:
        """The open session, without connecting (``None`` when there is none)."""
        with self._lock:
            return self._session

    def namespace(self, spec: NamespaceSpec) -> Namespace:
        """``spec``'s namespace on the open session (connecting if needed)."""
        return self.session().namespace(spec)

    def call(self, what: str, fn: Callable[[Session], T], miss: T) -> T:
        """``fn(session)``, once more on a new session if the connection was lost under it;
        ``miss`` (logged, counted) when the daemon cannot serve it."""
        for attempt in (1, 2):
            session: Session | None = None
            try:
                session = self.session()
                return fn(session)
            except KvtierError as exc:
                if session is not None and self.lost(exc, session) and attempt == 1:
                    continue
                return self.missed(what, exc, miss)
        raise AssertionError("unreachable")

    def lost(self, exc: BaseException, session: Session | None = None) -> bool:
        """Whether ``exc`` lost the connection of ``session`` (default: the open one); if so
        that session is dropped, unless another took its place meanwhile, and the next call
        connects anew."""
        if not is_connection_loss(exc):
            return False
        with self._lock:
            dropped = self._session if session is None or self._session is session else None
            if dropped is not None:
                self._session = None
        if dropped is not None:
            dropped.close()
        return True

    def missed(self, what: str, exc: KvtierError, miss: T) -> T:
        """Count and log a call the daemon could not serve (an outage once); returns
        ``miss``."""
        with self._lock:
            self.failures += 1
            down = self._down
        # while the daemon is away, "unreachable" was said once already; a refusal is the
        # daemon doing its job (full, over quota), said quietly
        if down:
            level = logging.DEBUG
        else:
            level = logging.WARNING if is_connection_loss(exc) else logging.INFO
        self._log.log(level, "kvtierd %s failed, answered as a miss: %s", what, exc)
        return miss

    def _went_down(self, exc: BaseException) -> None:
        self._failed += 1
        self._retry_at = time.monotonic() + _BACKOFF.backoff_s(self._failed)
        if not self._down:
            self._down = True
            self._log.warning("kvtierd unreachable, serving without it: %s", exc)

    def close(self) -> None:
        """Close the session; every later call answers its miss."""
        with self._lock:
            self._closed = True
            session, self._session = self._session, None
        if session is not None:
            session.close()


def _pinned(region: int, pinned: PinnedRegion) -> PinnedRegion | None:
    """``pinned``, registered as pinned memory (nothing to do for a CPU device); ``None``
    where the CUDA runtime refuses, said once: copies from the region are staged, not lost."""
    from kvtierd.client.cuda import CudaError

    try:
        pinned.pin()
    except CudaError as exc:
        logging.getLogger("kvtierd.engines").warning(
            "region %d stays unpinned (copies from it are staged): %s", region, exc
        )
        return None
    return pinned
