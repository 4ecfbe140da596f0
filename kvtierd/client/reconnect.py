"""Reconnecting to a restarted daemon, for both clients: the policy and the reopening.

A client given a :class:`Reconnect` policy replaces a broken connection: it connects and sends
INIT again, then reopens every namespace it still holds *before* any other request uses the new
connection, so that no request ever carries an old connection's namespace id. What it reopens,
and what it gives up, is the same in both clients, so it is written once here, sans-IO like
:mod:`kvtierd.client.ops`: :func:`reopen_namespaces` yields each OPEN_NS request to send and is
sent back ``(reply, fds)`` (or thrown the error the reply carried); a driver in
:mod:`kvtierd.client.sync` or :mod:`kvtierd.client.aio` only moves them.

A namespace the restarted daemon refuses, or gives another key salt (its secret changed, so
keys made before name other blocks), is marked ``lost``: its calls raise why, the other
namespaces go on. Leases and mapped regions of the old connection end with it (the errors
below say so to whoever uses them).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import anyio
import tenacity

from kvtierd.client.base import NamespaceHandle, Regions, close_all, handle_of
from kvtierd.errors import (
    BrokenConnectionError,
    InvalidRequestError,
    KvtierError,
    RemoteProtocolError,
    StartingError,
    TimedOutError,
)
from kvtierd.protocol.messages import Message, OpenNsReply, OpenNsRequest

__all__ = [
    "RECONNECTABLE",
    "Reconnect",
    "Reopenable",
    "gave_up",
    "lost_lease_error",
    "reopen_namespaces",
    "replaced_region_error",
]

#: What a reconnecting client tries again: the daemon is away, not ready yet, or not answering
#: INIT in time (a restart: the connection waits in systemd's socket while the old daemon
#: drains and writes back).
RECONNECTABLE = (BrokenConnectionError, StartingError, TimedOutError)


@dataclass(frozen=True, slots=True)
class Reconnect:
    """How a client reconnects when its connection to the daemon breaks (a restart, an
    upgrade), and how ``connect(reconnect=...)`` waits for a daemon that is not serving yet:
    the first attempt at once, then backing off from ``first_backoff_s``, doubling up to
    ``max_backoff_s``, each wait with up to ``jitter_s`` added at random (so that a host's
    engines do not all come back in one instant), for up to ``timeout_s`` in all and at most
    ``attempts`` (``None``: as many as fit). The defaults wait five minutes: a daemon
    pre-faulting a large arena, or recovering its NVMe index after a crash, takes minutes to
    serve. The backoff is tenacity's (``wait_exponential_jitter``), which neither logs nor
    counts anything of its own. What is retried and what is not is in ``docs/client.md``
    ("Reconnecting")."""

    attempts: int | None = None
    first_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    timeout_s: float = 300.0
    jitter_s: float = 0.25

    def __post_init__(self) -> None:
        if self.attempts is not None and not 1 <= self.attempts <= 1000:
            raise InvalidRequestError(f"reconnect attempts must be 1..1000, not {self.attempts}")
        if not 0 <= self.first_backoff_s <= self.max_backoff_s <= 60:
            raise InvalidRequestError(
                "reconnect backoff needs 0 <= first_backoff_s <= max_backoff_s <= 60"
            )
        if not 0 < self.timeout_s <= 3600 or not 0 <= self.jitter_s <= 60:
            raise InvalidRequestError(
                "reconnect needs 0 < timeout_s <= 3600 and 0 <= jitter_s <= 60"
            )

    def retrying(self) -> tenacity.Retrying:
        """The attempts, for the blocking client: ``for attempt in ...: with attempt:``; a
        :data:`RECONNECTABLE` error inside is retried, anything else raised at once, and once
        the policy is spent the last error is raised (:func:`gave_up` says so)."""
        return tenacity.Retrying(sleep=time.sleep, **self._tenacity())

    def retrying_async(self) -> tenacity.AsyncRetrying:
        """:meth:`retrying` for the async client (``async for``), sleeping on the running
        event loop (asyncio or trio)."""
        return tenacity.AsyncRetrying(sleep=anyio.sleep, **self._tenacity())

    def backoff_s(self, failed: int) -> float:
        """The wait after ``failed`` attempts in a row (tenacity's, as :meth:`retrying` waits):
        for a caller that does not wait but skips attempts until then (an engine's link)."""
        state = tenacity.RetryCallState(self.retrying(), None, (), {})
        state.attempt_number = max(failed, 1)
        return float(self._tenacity()["wait"](state))

    def _tenacity(self) -> dict[str, Any]:
        stop: Any = tenacity.stop_after_delay(self.timeout_s)
        if self.attempts is not None:
            stop = stop | tenacity.stop_after_attempt(self.attempts)
        return {
            "retry": tenacity.retry_if_exception_type(RECONNECTABLE),
            "stop": stop,
            "wait": tenacity.wait_exponential_jitter(
                multiplier=self.first_backoff_s, max=self.max_backoff_s, jitter=self.jitter_s
            ),
            "reraise": True,
        }


class Reopenable(Protocol):
    """A namespace as reopening sees it, sync or async."""

    handle: NamespaceHandle
    #: Why it cannot be used any more (``None`` while it can).
    lost: KvtierError | None


N = TypeVar("N", bound=Reopenable)

#: Yields OPEN_NS requests, is sent ``(reply, fds)``, returns the new handle of each namespace.
Reopening = Generator[OpenNsRequest, tuple[Message, list[int]], list[tuple[N, NamespaceHandle]]]


def reopen_namespaces(namespaces: Iterable[N], regions: Regions) -> Reopening[N]:
    """Open every namespace of ``namespaces`` that is not lost again (one OPEN_NS per distinct
    request), mapping the regions the replies pass into ``regions``. Returns each namespace
    with its new handle; one that cannot be used again is marked ``lost`` instead. An error
    after which the new connection is unusable (:data:`RECONNECTABLE`) propagates: the caller
    tries another connection. The driver closes the descriptors of a reply it throws in."""
    handles: list[tuple[N, NamespaceHandle]] = []
    opened: dict[OpenNsRequest, NamespaceHandle | KvtierError] = {}
    for ns in list(namespaces):
        if ns.lost is not None:
            continue
        request = ns.handle.request
        if request not in opened:
            opened[request] = yield from _open_again(request, regions)
        try:
            handles.append((ns, _same_keys(ns.handle, opened[request])))
        except KvtierError as exc:
            ns.lost = exc
    return handles


def _open_again(
    request: OpenNsRequest, regions: Regions
) -> Generator[OpenNsRequest, tuple[Message, list[int]], NamespaceHandle | KvtierError]:
    try:
        reply, fds = yield request
    except RECONNECTABLE:
        raise
    except KvtierError as exc:  # refused: this namespace is lost, the others go on
        return exc
    if not isinstance(reply, OpenNsReply):
        close_all(fds)
        raise RemoteProtocolError("OPEN_NS was not answered with OPEN_NS")
    regions.adopt(reply, fds)
    return handle_of(request, reply)


def _same_keys(old: NamespaceHandle, reply: NamespaceHandle | KvtierError) -> NamespaceHandle:
    """The reopened handle, if the keys a caller made with the old one still name its blocks;
    raises why the namespace cannot be used otherwise."""
    if isinstance(reply, KvtierError):
        raise type(reply)(f"namespace {old.name!r} could not be opened again: {reply}")
    if reply.key_salt != old.key_salt:
        raise InvalidRequestError(
            f"the restarted daemon gives namespace {old.name!r} another key salt (its secret "
            "changed): keys made before are not its keys; open it again"
        )
    return reply


def gave_up(last: KvtierError, attempts: int) -> KvtierError:
    """What a client raises when its ``attempts`` to reconnect all failed (``last``: the last
    attempt's error; its class, so ``DaemonNotRunningError`` stays catchable)."""
    return type(last)(f"{last} (gave up reconnecting after {attempts} attempts)")


def replaced_region_error() -> BrokenConnectionError:
    return BrokenConnectionError(
        "this region was mapped for the connection before the client reconnected to a "
        "restarted daemon: use the namespace's arena again"
    )


def lost_lease_error() -> BrokenConnectionError:
    return BrokenConnectionError(
        "this lease ended with the connection it was taken on (the client reconnected to a "
        "restarted daemon): lease the blocks again"
    )
