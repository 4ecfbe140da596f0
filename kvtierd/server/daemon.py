"""The daemon: open the store behind its listeners (the Unix socket, and TCP:
:mod:`kvtierd.server.accepting`), serve sessions, stop cleanly.

Lifecycle. ``serve_daemon`` takes the data directory's lock, binds the socket with the
configured mode and group (refusing when another kvtierd answers there) and the metrics
listener, and only then opens the store, which may take minutes (pre-faulting a large arena,
scanning a large NVMe file): meanwhile every connection gets the ``EAGAIN`` fatal frame of
:class:`~kvtierd.errors.StartingError` saying how far it is (``starting: pre-faulting the arena,
3.0 of 8.0 GiB``), ``/ready`` answers 503 with the same words, and each advance extends
systemd's start timeout (``EXTEND_TIMEOUT_USEC``) so a start that progresses is never killed
for its length. Once the store is open it tells systemd READY=1 and serves until SIGTERM or
SIGINT (which, during start-up, abandons the opening). Then it stops accepting, lets every
session finish the requests it has in flight (for at most ``shutdown_grace_s``), tells systemd
STOPPING=1, and closes the store, which writes back what is dirty and saves the index snapshot.
Every task it starts lives in its task group.

Admission. A new connection takes a slot under its listener's limits, or an idle connection
the limits count gives its slot up for it, or it is refused with an ``EBUSY`` frame: the rules
are :mod:`kvtierd.server.admission`'s, the daemon closes the connection they name (with an
``EBUSY`` frame of its own). Idle connections are closed for nothing else. Each connection must
then have INIT answered within ``handshake_timeout_s`` (:mod:`kvtierd.server.session`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import os
import signal
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import sniffio
from anyio.abc import ByteStream, SocketStream, TaskStatus, UNIXSocketStream

from kvtierd import __version__
from kvtierd.config import Config
from kvtierd.config_render import config_digest, differences, render_config
from kvtierd.errors import BusyError
from kvtierd.io import BindingVerdict
from kvtierd.nixl.export import NIXL_OFF, NixlReads
from kvtierd.pool.link import PoolLink
from kvtierd.protocol.messages import (
    ConfigReply,
    PoolStatusReply,
    StatfsReply,
    TenantStatistics,
    TierStatistics,
)
from kvtierd.server import activation, heap
from kvtierd.server.accepting import Entrance, listen_unix, refuse, serve_connections
from kvtierd.server.admission import make_room, slot_limits
from kvtierd.server.assembly import open_daemon_store
from kvtierd.server.budget import reserve_descriptors, unix_uid_share
from kvtierd.server.checks import HostCheck
from kvtierd.server.collector import serve_collector
from kvtierd.server.doctor import RunningFacts, running_report
from kvtierd.server.endpoint import serve_endpoint
from kvtierd.server.fdstore import FdStore
from kvtierd.server.hangups import Hangups
from kvtierd.server.metrics import Metrics, RequestTimings
from kvtierd.server.notify import Notifier
from kvtierd.server.readiness import DaemonPhase, Readiness
from kvtierd.server.reload import Reload, plan_reload
from kvtierd.server.remote import open_remote_listener
from kvtierd.server.session import Session, peer_credentials, throttle_key
from kvtierd.server.summary import startup_summary
from kvtierd.server.throttle import Throttle
from kvtierd.store.counts import StoreStatistics
from kvtierd.store.index import Block
from kvtierd.store.lifecycle import arena_bytes
from kvtierd.store.namespaces import PeerCredentials
from kvtierd.store.reports import TenantFigures
from kvtierd.store.store import BlockStore

__all__ = ["Daemon", "serve_daemon"]

log = logging.getLogger("kvtierd")


def _disk_failing(store: BlockStore) -> str:
    """The disk tier's failing condition and its remedy, for the report; empty while healthy."""
    condition = store.disk.health.condition if store.disk is not None else None
    return f"{condition.describe()}; {condition.remedy}" if condition is not None else ""


#: STATFS fields that are the store's figures of the same name, copied as they are.
_STORE_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(StoreStatistics)
    if f.name not in ("tiers", "checkpoints", "counts")
)


def _statfs(
    figures: StoreStatistics,
    sessions: Collection[Session],
    tenants: Sequence[TenantFigures],
    *,
    uptime_s: float,
    requests: int,
) -> StatfsReply:
    """STATFS: the store's ``figures``, what ``sessions`` hold (leases, writes) and the
    ``tenants``' figures."""
    taken = figures.checkpoints
    checkpoints: dict[str, Any] = {}
    if taken is not None:
        checkpoints = {
            "checkpoints": taken.state,
            "checkpoints_written": taken.written,
            "checkpoint_age_s": taken.age_s if taken.age_s is not None else -1.0,
            "bytes_since_checkpoint": taken.bytes_since,
            "checkpoint_longest_slice_s": taken.longest_slice_s,
        }
    return StatfsReply(
        version=__version__,
        uptime_s=uptime_s,
        connections=len(sessions),
        requests=requests,
        leases=sum(len(s.owner.leases) for s in sessions),
        leased_blocks=sum(len(lease.blocks) for s in sessions for lease in s.owner.leases.values()),
        pending_writes=sum(len(s.owner.writes) for s in sessions),
        tiers=[TierStatistics(**dataclasses.asdict(tier)) for tier in figures.tiers],
        **{name: getattr(figures, name) for name in _STORE_FIELDS},
        **checkpoints,
        tenants=[_tenant_statistics(t) for t in tenants],
    )


def _tenant_statistics(t: TenantFigures) -> TenantStatistics:
    c = t.counts
    return TenantStatistics(
        tenant=t.tenant or "",
        namespaces=t.namespaces,
        dram_blocks=t.dram_blocks,
        dram_used_bytes=t.dram_used_bytes,
        dram_capacity_bytes=t.dram_capacity_bytes,
        nvme_blocks=t.nvme_blocks,
        nvme_used_bytes=t.nvme_used_bytes,
        dram_hits=c.dram_hits,
        nvme_hits=c.lower_hits,
        pool_hits=c.pool_hits,
        misses=c.misses,
        dram_evictions=c.dram_evictions,
        bytes_read=c.bytes_read,
        bytes_committed=c.bytes_committed,
    )


class Daemon:
    """What every session shares: the configuration, the store and the counters."""

    def __init__(
        self,
        config: Config,
        store: BlockStore,
        startup: Sequence[HostCheck] = (),
        timings: RequestTimings | None = None,
        nixl: NixlReads | None = None,
        *,
        pool: PoolLink[Block] | None = None,
        source: str = "",
    ) -> None:
        self.config = config
        self.store = store
        #: The NIXL export of the arena's tenant regions, or why there is none.
        self.nixl = nixl if nixl is not None else NIXL_OFF
        #: The store's link to the shared pool, when one is configured.
        self.pool = pool
        self.startup = tuple(startup)
        #: Request latency histograms, when metrics are served.
        self.timings = timings
        self.sessions: set[Session] = set()
        #: The open sessions of each peer uid, which ``max_connections_per_uid`` bounds.
        self.sessions_of_uid: dict[int, set[Session]] = {}
        self.requests = 0
        self.started = time.monotonic()
        self.idle = anyio.Event()
        #: Warnings about peers (refused, silent in INIT), at most once a minute per peer.
        self.peer_warnings = Throttle()
        #: Where the configuration came from, and its digest (CONFIG, ``kvtierd_info``).
        self.source = source
        self.config_digest = config_digest(config)
        self._config_reply = self._render_configuration()

    def count_request(self) -> None:
        self.requests += 1

    def statistics(
        self, peer: PeerCredentials | None = None, *, figures: StoreStatistics | None = None
    ) -> StatfsReply:
        """The STATFS record: the host's (``peer`` None: for the admin), or only what belongs to
        the tenants ``peer`` is admitted to and its own uid's connections, so that no tenant
        sees another's traffic (host-wide figures are 0). ``figures``: the store's for that
        scope, when the caller took them already."""
        if figures is None:
            figures = self.store.statistics(peer)
        uptime_s = time.monotonic() - self.started
        tenants = self.store.tenant_statistics()
        if peer is None:
            return _statfs(
                figures, self.sessions, tenants, uptime_s=uptime_s, requests=self.requests
            )
        registry = self.store.registry
        own_tenants = [
            t for t in tenants if t.tenant is not None and registry.may_use(t.tenant, peer)
        ]
        own = self.sessions_of_uid.get(peer.uid, set())
        requests = sum(s.requests for s in own)
        return _statfs(figures, own, own_tenants, uptime_s=uptime_s, requests=requests)

    def reload(self, read: Config) -> Reload:
        """SIGHUP with the configuration just ``read``: the live settings applied
        (:mod:`kvtierd.server.reload`), what waits for a restart said; the :class:`Reload`."""
        plan = plan_reload(self.config, read)
        self.config = plan.config
        self.config_digest = config_digest(plan.config)
        self._config_reply = self._render_configuration()
        logging.getLogger().setLevel(plan.config.daemon.log_level.value.upper())
        self.store.prefetcher.prefetch_bytes_per_s = plan.config.dram.prefetch_bytes_per_s
        for d in plan.applied:
            log.info("SIGHUP: %s %s -> %s", d.name, d.before, d.after)
        if plan.held:
            log.warning(
                "SIGHUP: not applied until a restart: %s",
                "; ".join(f"{d.name} {d.before} -> {d.after}" for d in plan.held),
            )
        if not plan.applied and not plan.held:
            log.info("SIGHUP: the configuration is unchanged")
        return plan

    def configuration(self) -> ConfigReply:
        """CONFIG: the configuration this daemon runs, every field, and what differs from the
        defaults (rendered once per configuration, not per request)."""
        return self._config_reply

    def _render_configuration(self) -> ConfigReply:
        changed = [d.name for d in differences(Config(), self.config)]
        return ConfigReply(self.source, self.config_digest, render_config(self.config), changed)

    def pool_status(self) -> PoolStatusReply:
        """Where this daemon stands with the pool, every figure (the admin's POOL_STATUS and
        the metrics); state ``"none"`` when no pool is configured."""
        store = self.store
        link = self.pool
        if link is None:
            return PoolStatusReply("none", "no pool is configured (pool.url is empty)")
        status = link.membership.status
        config = link.config
        return PoolStatusReply(
            state=status.state.value,
            reason=status.reason,
            address=link.membership.address,
            group=link.tier.names.group,
            rank=config.rank,
            world_size=config.world_size,
            write_policy=config.write_policy.value,
            epoch=status.epoch,
            members=list(status.members),
            refusals=dict(status.refusals),
            changed_at=status.changed_at,
            backlog_blocks=len(link.pending),
            backlog_bytes=link.pending_bytes,
            unreached=len(link.unreached),
            pool_hits=store.residency.statistics().pool_hits,
            **dataclasses.asdict(link.statistics()),
        )

    async def doctor(self) -> list[HostCheck]:
        """The report on this host: the start-up checks with what is known now in their place."""
        store = self.store
        backend = store.io_backend
        stats = backend.statistics() if backend is not None else None
        status = self.pool.membership.status if self.pool is not None else None
        nvme = store.lower.statistics() if store.lower is not None else None
        facts = RunningFacts(
            config=self.config,
            startup=self.startup,
            io_kind=backend.kind if backend is not None else None,
            fixed_ops=stats.fixed_ops if stats else 0,
            io_ops=stats.completed - stats.fsyncs if stats else 0,
            arena_bytes=arena_bytes(self.config),
            nvme_used_bytes=nvme.used_bytes if nvme else 0,
            nvme_capacity_bytes=nvme.capacity_bytes if nvme else 0,
            hugepages=store.arena.info.hugepages,
            locked=store.arena.info.locked,
            pool_state=status.state.value if status else "",
            pool_reason=status.reason if status else "",
            disk_failing=_disk_failing(store),
            fixed_fallback=backend.fixed_buffers_fallback if backend is not None else "",
        )
        return await anyio.to_thread.run_sync(running_report, facts)

    async def handle(self, stream: SocketStream) -> None:
        """Serve a connection to the Unix socket, or tell it why not (``EBUSY``)."""
        assert isinstance(stream, UNIXSocketStream)
        peer = peer_credentials(stream)
        try:
            session = self.admit(stream, peer, direct=True)
        except BusyError as exc:
            key = throttle_key(peer)
            self.peer_warnings.report(log, logging.WARNING, key, "refusing %s: %s", peer, exc)
            await refuse(stream, exc)
            return
        await self.serve(session)

    def admit(self, stream: ByteStream, peer: PeerCredentials, *, direct: bool) -> Session:
        """A session for ``stream`` of ``peer``, counted by its listener's limits; raises
        :class:`BusyError` when it does not fit. ``direct``: replies may be written to the
        stream's socket directly. The caller then runs it (:meth:`serve`) at once."""
        self._make_room(peer)
        log.debug("connection from %s", peer)
        session = Session(self, stream, peer, direct=direct)
        self.sessions.add(session)
        self.sessions_of_uid.setdefault(peer.uid, set()).add(session)
        if self.idle.is_set():
            self.idle = anyio.Event()
        return session

    async def serve(self, session: Session) -> None:
        """Run an admitted session to its end."""
        try:
            await session.serve()
        finally:
            self._forget(session)
            if not self.sessions:
                self.idle.set()
            log.debug(
                "%s (client %r) disconnected after %d request(s)",
                session.peer, session.owner.name, session.requests,
            )  # fmt: skip

    def _make_room(self, peer: PeerCredentials) -> None:
        """Return when a new connection of ``peer`` fits in its listener's limits, once the
        idle connection :func:`~kvtierd.server.admission.make_room` picked has given its slot
        up; else raise :class:`BusyError` saying why it does not fit."""
        limits = slot_limits(self.config, peer)
        victim = make_room(self.sessions, peer, limits, time.monotonic())
        if victim is not None:
            self._close_idle(victim)

    def _close_idle(self, victim: Session) -> None:
        quiet_s = time.monotonic() - victim.last_request_s
        log.warning(
            "closing pid %d uid %d, idle for %.1f s, to admit a new connection",
            victim.peer.pid,
            victim.peer.uid,
            quiet_s,
        )
        victim.close_with(BusyError(f"closed after {quiet_s:.1f} s idle: its slot was needed"))
        self._forget(victim)

    def _forget(self, session: Session) -> None:
        self.sessions.discard(session)
        own = self.sessions_of_uid.get(session.peer.uid)
        if own is not None:
            own.discard(session)
            if not own:
                del self.sessions_of_uid[session.peer.uid]


def _tolerate_duplicate_readiness() -> None:
    """On asyncio (uvloop), anyio waits for a readable socket with a future that the loop's
    reader callback resolves; when the descriptor fires twice before the future's done-callback
    removes the reader, the second ``set_result`` raises ``InvalidStateError`` inside the loop.
    Nothing is lost (the future is already resolved), but the loop logs it as an error with a
    traceback. Log exactly that case at debug level; everything else goes to the usual handler.
    """
    if sniffio.current_async_library() != "asyncio":
        return
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        where = f"{context.get('message', '')} {context.get('handle', '')!r}"
        if isinstance(exc, asyncio.InvalidStateError) and "set_result" in where:
            log.debug("ignored a duplicate readiness callback: %s", context.get("message"))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


@contextlib.contextmanager
def _exclusive(data_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on the data directory: two daemons must never share a data file."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / "kvtierd.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise BusyError(f"{data_dir} is in use by another kvtierd (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


async def serve_daemon(
    config: Config,
    *,
    startup: Sequence[HostCheck] = (),
    io_verdict: BindingVerdict | None = None,
    source: str = "",
    reread: Callable[[], Config] | None = None,
    task_status: TaskStatus[Daemon] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run the daemon until SIGTERM/SIGINT (or cancellation); returns after a clean stop, or
    after SIGTERM during start-up (without ever calling ``task_status.started``); SIGINT
    during start-up raises ``KeyboardInterrupt`` once the opening is abandoned.

    ``startup`` is what :func:`kvtierd.server.preflight.check_host` found (kept for
    ``kvtierctl doctor``) and ``io_verdict`` the liburing binding's probe verdict; without it the
    io backend probes the binding itself. ``source`` says where the configuration came from
    (the start-up summary line names it); ``reread`` reads it again, from the same file and
    flags, for SIGHUP (:mod:`kvtierd.server.reload`; without it a SIGHUP is logged and ignored).
    """
    _tolerate_duplicate_readiness()
    notifier = Notifier()
    readiness = Readiness()
    entrance = Entrance(readiness)
    notifier.status(str(readiness.starting_error()))
    budget = reserve_descriptors(config)
    with _exclusive(config.data_path):
        async with (
            listen_unix(config) as listener,
            open_remote_listener(
                config.remote, handshake_timeout_s=config.daemon.handshake_timeout_s
            ) as remote,
            anyio.create_task_group() as tg,
        ):
            accepting = anyio.CancelScope()
            tg.start_soon(
                partial(
                    serve_connections, unix_cap=budget.unix, unix_per_uid=unix_uid_share(config)
                ),
                listener, entrance, accepting, remote,
            )  # fmt: skip
            tg.start_soon(notifier.run_watchdog)
            metrics = Metrics(config.daemon, readiness) if config.daemon.metrics_port else None
            if metrics is not None:
                await tg.start(serve_endpoint, config.daemon, metrics)
            stop = _Stop()
            hangups = Hangups(tg, readiness, reread, metrics)
            tg.start_soon(hangups.watch)  # SIGHUP, for the daemon's whole life
            with anyio.CancelScope() as opening:
                tg.start_soon(_watch_stop_signals, readiness, stop, opening)
                tg.start_soon(_extend_start_timeout, readiness, notifier)
                keeper = FdStore(
                    activation.take_stored(),
                    os.environ,
                    enabled=config.dram.keep_across_restarts,
                )
                async with open_daemon_store(
                    config, io_verdict=io_verdict, progress=readiness.progress, keeper=keeper
                ) as assembled:
                    await anyio.to_thread.run_sync(heap.trim)  # what recovery freed (heap.py)
                    timings = metrics.timings if metrics is not None else None
                    store = assembled.store
                    daemon = Daemon(
                        config,
                        store,
                        startup,
                        timings,
                        assembled.nixl,
                        pool=assembled.pool,
                        source=source or "unknown (not given to serve_daemon)",
                    )
                    disk = store.disk.health if store.disk is not None else None
                    readiness.serve(str(config.socket_path), disk)
                    entrance.open(daemon)
                    tg.start_soon(serve_collector)
                    if metrics is not None:
                        metrics.observe(daemon)
                    notifier.ready(f"serving on {config.socket_path}")
                    backend = store.io_backend
                    summary = startup_summary(
                        config,
                        source=source,
                        io_backend=backend.kind.value if backend is not None else "none",
                        arena_bytes=arena_bytes(config),
                        locked=store.arena.info.locked,
                    )
                    log.info("%s", summary)
                    hangups.serving = daemon
                    task_status.started(daemon)
                    await stop.event.wait()
                    notifier.stopping()
                    await _drain(daemon, accepting, daemon.config.daemon.shutdown_grace_s)
            if opening.cancelled_caught:
                log.info("stopped while starting (%s)", readiness.progress.describe())
            tg.cancel_scope.cancel()
    if opening.cancelled_caught and stop.signal is signal.SIGINT:
        raise KeyboardInterrupt  # Ctrl-C before serving: "kvtierd: interrupted", status 130
    log.info("kvtierd stopped cleanly")


#: Each advance of the opening extends systemd's start timeout by this much from then on; at
#: most one extension per :data:`_EXTEND_EVERY_S`, so a start that stops advancing times out.
_EXTEND_S = 60.0
_EXTEND_EVERY_S = 5.0


async def _extend_start_timeout(readiness: Readiness, notifier: Notifier) -> None:
    """While starting, tell systemd each advance: STATUS=starting: ... and EXTEND_TIMEOUT_USEC
    (a start that makes progress is never killed for its length, one that stalls still is)."""
    seen = readiness.progress.steps
    while readiness.phase is DaemonPhase.STARTING:
        await anyio.sleep(_EXTEND_EVERY_S)
        steps = readiness.progress.steps
        if steps != seen and readiness.phase is DaemonPhase.STARTING:
            seen = steps
            notifier.extend_timeout(_EXTEND_S, str(readiness.starting_error()))


async def _watch_stop_signals(
    readiness: Readiness, stop: _Stop, opening: anyio.CancelScope
) -> None:
    """Until SIGTERM or SIGINT: then ``stopping``; a daemon still starting abandons the
    opening, a serving one drains (``stop``)."""
    stop.signal = await _wait_for_stop_signal()
    starting = readiness.phase is DaemonPhase.STARTING
    readiness.stop()
    if starting:
        opening.cancel()
    stop.event.set()


class _Stop:
    """The stop signal, once it came."""

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.signal: signal.Signals | None = None


async def _wait_for_stop_signal() -> signal.Signals:
    """The first SIGTERM or SIGINT."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("%s: stopping", signal.Signals(signum).name)
            return signal.Signals(signum)
    raise AssertionError("the signal receiver ended")  # it never does


async def _drain(daemon: Daemon, serving: anyio.CancelScope, grace_s: float) -> None:
    serving.cancel()
    for session in list(daemon.sessions):
        session.stop_reading()
    if daemon.sessions:
        with anyio.move_on_after(grace_s):
            await daemon.idle.wait()
    if daemon.sessions:
        log.warning(
            "%d sessions still busy after %.0f s; closing them", len(daemon.sessions), grace_s
        )
