"""The daemon's side of one region's exporter process: starting it, speaking to it, and starting
it again when it dies.

Theory of operation
-------------------
Each tenant region is exported over NIXL by a process of its own (:mod:`kvtierd.nixl.exporter`
says why: NIXL checks no access, so the process is the bound). :class:`RegionExporter` starts it
with ``exec`` of ``python -m kvtierd.nixl.exporter`` (``anyio.open_process``: no fork of the
daemon survives), passing exactly three descriptors, the region's sealed memory file, the
region's landing memory file and one end of a Unix socket pair (stdin and stdout
``/dev/null``, stderr a pipe relayed to the daemon's log, rate-limited: :class:`_Relay`), and
an environment of UCX's, NIXL's and the interpreter's variables only
(:func:`exporter_environment`), and waits up to the start timeout for its
:class:`~kvtierd.nixl.control.Ready`. That message carries everything NIXL_GRANT and READ_NIXL
need (the agent's name and the metadata of its one registration, where the region is mapped in
the exporter), so answering them takes no round trip: :meth:`RegionExporter.grant` and
:meth:`RegionExporter.describe` are plain calls. Descriptors are kvtierd's own format
(:mod:`kvtierd.nixl.descriptors`), not NIXL's, so the daemon encodes them itself, in the
exporter's addresses.

What does go to the exporter, over the control socket and always under a deadline: a stir
whenever a grant or a NIXL lease of the region is handed out and every :data:`STIR_EVERY_S`
while such a lease is held (the exporter drives UCX's progress for its linger after each: a
peer reading over TCP needs it), and the pulls of peer restores (:meth:`RegionExporter.pull`).

Peer restores and the landing buffer. The exporter maps its region read-only (a NIXL peer can
WRITE whatever the exporter registered), so a peer restore cannot be pulled into the arena
slot there. Each exporter has a small landing memory file instead, made here (sealed against
resizing, so that the exporter can never make the daemon's copy fault) in
:data:`LANDING_SLOTS` slots of the largest block (``limits.max_block_bytes``), mapped
read-only by the daemon and writable by the exporter: :meth:`RegionExporter.pull_into` takes a
slot, has the exporter pull the peer's bytes into it, then copies them into the arena slot and
hashes **the copy** (:func:`~kvtierd.store.codec.copy_checksum_off_loop`): a NIXL peer can
still write the landing buffer, so only the bytes the daemon holds are checked (against the
manifest's checksum, by the caller). A send that does not complete within :data:`CONTROL_TIMEOUT_S`,
or a pull not answered :data:`PULL_SLACK_S` after its own deadline, means a hung exporter: it
is killed. So is one whose pull the daemon stops waiting for (a cancellation): a transfer the
daemon gave up on must not go on writing into a landing slot it may reuse.

Supervision (:meth:`RegionExporter.supervise`, a task of the daemon's): when the exporter's
control socket closes (it died, or was killed), every pull awaiting it fails, one warning says
how it ended, and another is started after :class:`~kvtierd.nixl.restarts.RestartBackoff`'s
delay; until it is ready, NIXL_GRANT, READ_NIXL and pulls of that region fail with
:class:`ExporterUnavailableError` (``EAGAIN``) saying why. Other regions' exporters, and the
daemon, never notice. Cancelling the task kills the exporter it runs. An exporter whose daemon
died sees its control socket close and exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import mmap
import os
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NoReturn

import anyio
import anyio.abc

from kvtierd.childprobe import child_environment, died_of
from kvtierd.errors import (
    InvalidRequestError,
    KvtierError,
    RemoteProtocolError,
    StartingError,
    TimedOutError,
    error_from_errno,
)
from kvtierd.nixl import descriptors
from kvtierd.nixl.agent import Extent, TransferError
from kvtierd.nixl.control import FrameDecoder, FromExporter, Pull, Pulled, Ready, Stir, encode
from kvtierd.nixl.restarts import RestartBackoff
from kvtierd.store.codec import copy_checksum_off_loop
from kvtierd.store.regions import TenantRegion

__all__ = [
    "CONTROL_TIMEOUT_S",
    "ExporterUnavailableError",
    "RegionExporter",
    "RegionGrant",
    "check_extents",
    "exporter_environment",
]

log = logging.getLogger("kvtierd.nixl")

#: The longest a control message may take to be sent (the socket's buffer full: a hung exporter).
CONTROL_TIMEOUT_S = 5.0
#: While a NIXL lease of the region is held, the exporter is stirred this often (it drives UCX's
#: progress for 5 s after each stir).
STIR_EVERY_S = 1.0
#: How long after a pull's own deadline its answer may come before the exporter counts as hung.
PULL_SLACK_S = 5.0
#: Peer-restore pulls one exporter carries at once: its landing buffer has this many slots.
LANDING_SLOTS = 2
#: Lines of an exporter's stderr relayed to the daemon's log per :data:`RELAY_WINDOW_S`, and the
#: longest line relayed (the rest is cut): an exporter is reachable by NIXL peers, and its
#: output must not flood the daemon's log.
RELAY_LINES = 20
RELAY_WINDOW_S = 10.0
RELAY_LINE_CHARS = 1000
_RECEIVE_BYTES = 1 << 16


class ExporterUnavailableError(StartingError):
    """The region's exporter is not serving now: it died (or was killed) and another is being
    started, or it could not start (``EAGAIN``; the message says which). Try again shortly."""


@dataclass(frozen=True, slots=True)
class RegionGrant:
    """What a client of one tenant gets: the region it may pull from, the exporter's agent, and
    the metadata of that agent's one registration, the region."""

    region_id: int
    agent: str
    metadata: bytes


@dataclass(eq=False)
class _Waiter:
    done: anyio.Event = field(default_factory=anyio.Event)
    reply: Pulled | None = None


class _Relay:
    """An exporter's stderr, line by line into the daemon's log: at most :data:`RELAY_LINES`
    per :data:`RELAY_WINDOW_S` (the rest counted and said once the window ends), each cut at
    :data:`RELAY_LINE_CHARS`."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._partial = b""
        self._window = float("-inf")
        self._lines = 0
        self._dropped = 0

    def feed(self, data: bytes) -> None:
        *lines, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > RELAY_LINE_CHARS:
            lines.append(self._partial)
            self._partial = b""
        for line in lines:
            self._say(line)

    def flush(self) -> None:
        if self._partial:
            self._say(self._partial)
            self._partial = b""
        if self._dropped:
            log.warning("NIXL exporter of %s: %d more line(s) not logged", self.label,
                        self._dropped)  # fmt: skip
            self._dropped = 0

    def _say(self, line: bytes) -> None:
        now = time.monotonic()
        if now - self._window >= RELAY_WINDOW_S:
            if self._dropped:
                log.warning("NIXL exporter of %s: %d more line(s) not logged", self.label,
                            self._dropped)  # fmt: skip
            self._window, self._lines, self._dropped = now, 0, 0
        if self._lines >= RELAY_LINES:
            self._dropped += 1
            return
        self._lines += 1
        text = line.decode(errors="replace").rstrip()[:RELAY_LINE_CHARS]
        if text:
            log.warning("NIXL exporter of %s: %s", self.label, text)


class _Link:
    """One running exporter process: its control stream, its :class:`Ready`, and the pulls
    awaiting its answer."""

    def __init__(
        self, process: anyio.abc.Process, stream: anyio.abc.SocketStream, ready: Ready, label: str
    ) -> None:
        self.process = process
        self.stream = stream
        self.ready = ready
        self.relay = _Relay(label)
        self.started_at = time.monotonic()
        self.pending: dict[int, _Waiter] = {}
        self._send_lock = anyio.Lock()

    async def send(self, message: Stir | Pull) -> None:
        """Send ``message``; raises :class:`ExporterUnavailableError` when the exporter is gone
        or takes more than :data:`CONTROL_TIMEOUT_S` (then it is killed)."""
        try:
            with anyio.fail_after(CONTROL_TIMEOUT_S):
                async with self._send_lock:
                    await self.stream.send(encode(message))
        except TimeoutError:
            self.kill()
            raise ExporterUnavailableError(
                f"the NIXL exporter took no control message in {CONTROL_TIMEOUT_S:g} s: killed"
            ) from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ExporterUnavailableError(f"the NIXL exporter is gone: {exc!r}") from None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    def fail_pending(self) -> None:
        """Wake every pull awaiting an answer that will not come."""
        for waiter in self.pending.values():
            waiter.done.set()
        self.pending.clear()

    async def relay_stderr(self) -> None:
        """Relay the exporter's stderr to the daemon's log until it closes."""
        stderr = self.process.stderr
        if stderr is None:
            return
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError,
                                 anyio.ClosedResourceError):  # fmt: skip
            while True:
                self.relay.feed(await stderr.receive(_RECEIVE_BYTES))

    async def aclose(self) -> str:
        """Kill the process (if it still runs), reap it, log what it left on stderr and close
        the streams; how it ended."""
        with anyio.CancelScope(shield=True):
            self.kill()
            with anyio.move_on_after(CONTROL_TIMEOUT_S):
                await self.process.wait()
            with anyio.move_on_after(1.0):
                await self.relay_stderr()
            self.relay.flush()
            await self.stream.aclose()
            if self.process.stderr is not None:
                await self.process.stderr.aclose()
        return _ending(self.process.returncode)


#: What an exporter's environment keeps of the daemon's: UCX's and NIXL's settings and what the
#: interpreter and the dynamic loader need. Nothing else (a secret the daemon's unit passed, for
#: one) enters a process whose memory NIXL peers can read.
_ENVIRONMENT_PREFIXES = ("UCX_", "NIXL_", "PYTHON", "LD_", "CUDA_", "LC_")
_ENVIRONMENT_NAMES = frozenset({"PATH", "HOME", "LANG", "TMPDIR", "VIRTUAL_ENV"})


def exporter_environment(environment: Mapping[str, str]) -> dict[str, str]:
    """``environment`` (the daemon's, :func:`~kvtierd.childprobe.child_environment`) less
    everything but :data:`_ENVIRONMENT_PREFIXES` and :data:`_ENVIRONMENT_NAMES`."""
    return {
        name: value
        for name, value in environment.items()
        if name in _ENVIRONMENT_NAMES or name.startswith(_ENVIRONMENT_PREFIXES)
    }


def _ending(returncode: int | None) -> str:
    if returncode is None:
        return "would not end"
    died = died_of(returncode)
    if died is not None:
        return f"died with {died[0]} ({died[1]})"
    return f"exited with status {returncode}"


class RegionExporter:
    """The exporter process of ``region`` and its supervision (module docstring). Agents are
    named ``{agent_prefix}-r{region id}-{generation}``: a restarted exporter's agent is a new
    one, so a client that loaded the old one's metadata sees the change in the descriptors.
    Construct, :meth:`start` once, then run :meth:`supervise` in a task group."""

    def __init__(
        self,
        region: TenantRegion,
        agent_prefix: str,
        *,
        start_timeout_s: float,
        landing_slot_bytes: int,
        user: str = "nobody",
        backoff: RestartBackoff | None = None,
    ) -> None:
        if start_timeout_s <= 0:
            raise ValueError("an exporter needs a positive start timeout")
        if landing_slot_bytes <= 0 or landing_slot_bytes % mmap.PAGESIZE:
            raise ValueError("a landing slot is a positive number of pages")
        self.region = region
        self.user = user
        self._prefix = agent_prefix
        self.landing_slot_bytes = landing_slot_bytes
        self._landing_fd, self._landing = _landing_file(
            f"nixl-landing-{region.tenant or 'default'}", LANDING_SLOTS * landing_slot_bytes
        )
        self._free_slots = list(range(LANDING_SLOTS))
        self._slots = anyio.Semaphore(LANDING_SLOTS)
        self._start_timeout_s = start_timeout_s
        self._backoff = backoff if backoff is not None else RestartBackoff()
        self._link: _Link | None = None
        self._why_down = "it has not started"
        #: Exporters started so far (the first one included).
        self.generation = 0
        #: Leases of this region's blocks handed out with descriptors and not yet released.
        self._held: weakref.WeakSet[object] = weakref.WeakSet()
        self._wake = anyio.Event()
        self._ids = itertools.count(1)

    @property
    def label(self) -> str:
        return f"region {self.region.id} ({self.region.tenant or 'default'})"

    @property
    def pid(self) -> int | None:
        """The running exporter's process id; ``None`` while none runs."""
        return self._link.process.pid if self._link is not None else None

    def grant(self) -> RegionGrant:
        """The agent and metadata a client of the region's tenant loads; raises
        :class:`ExporterUnavailableError` while no exporter serves."""
        ready = self._ready()
        self._wake.set()  # the pull that follows connects to the exporter
        return RegionGrant(self.region.id, ready.agent, ready.metadata)

    def describe(self, extents: list[Extent]) -> bytes:
        """Descriptors of ``extents`` (offsets in the region and lengths) in the exporter's
        addresses; :class:`~kvtierd.errors.InvalidRequestError` for one outside the region."""
        ready = self._ready()
        addresses = [(ready.address + offset, length) for offset, length in extents]
        return descriptors.encode(ready.agent, addresses, [(ready.address, ready.size_bytes)])

    def hold(self, lease: object) -> None:
        """Keep the exporter driving UCX's progress while ``lease`` exists."""
        self._held.add(lease)
        self._wake.set()

    async def pull_into(
        self, target: memoryview, agent: str, metadata: bytes, remote: bytes,
        *, timeout_s: float,
    ) -> int:  # fmt: skip
        """Fill ``target`` (an arena slot of this region, in the daemon) with ``remote``
        (descriptors of peer agent ``agent``, whose ``metadata`` the exporter loads if it has
        not): pulled by the exporter into a landing slot, then copied into ``target`` here. The
        xxh3-64 of the bytes now in ``target`` (the copy's, never the landing buffer's, which a
        NIXL peer can write), for the caller to check. Raises as :meth:`pull`, and
        :class:`~kvtierd.errors.InvalidRequestError` for a block larger than a landing slot."""
        length = len(target)
        if length > self.landing_slot_bytes:
            raise InvalidRequestError(
                f"a {length}-byte block is larger than the landing slot ({self.landing_slot_bytes})"
            )
        async with self._slots:
            slot = self._free_slots.pop()
            try:
                start = slot * self.landing_slot_bytes
                await self.pull(agent, metadata, remote, start, length, timeout_s=timeout_s)
                with memoryview(self._landing) as landing:
                    return await copy_checksum_off_loop(target, landing[start : start + length])
            finally:
                self._free_slots.append(slot)

    def close_landing(self) -> None:
        """Unmap and close the landing buffer (the daemon is stopping; no pull may follow)."""
        with contextlib.suppress(BufferError):
            self._landing.close()
        with contextlib.suppress(OSError):
            os.close(self._landing_fd)

    async def pull(
        self, agent: str, metadata: bytes, remote: bytes, offset: int, length: int,
        *, timeout_s: float,
    ) -> None:  # fmt: skip
        """Have the exporter read ``remote`` (descriptors of peer agent ``agent``, whose
        ``metadata`` it loads if it has not) into ``length`` bytes at ``offset`` of its landing
        buffer (:meth:`pull_into` is what the daemon uses).
        Raises what the exporter raised, :class:`ExporterUnavailableError` when it is not
        serving or died meanwhile, and :class:`~kvtierd.errors.TimedOutError` when it did not
        answer in time (then it is killed, as it is when this call is cancelled)."""
        link = self._require()
        request = Pull(next(self._ids), agent, metadata, remote, offset, length, timeout_s)
        waiter = link.pending[request.id] = _Waiter()
        try:
            await link.send(request)
            with anyio.move_on_after(timeout_s + PULL_SLACK_S):
                await waiter.done.wait()
        finally:
            link.pending.pop(request.id, None)
            if waiter.reply is None:
                link.kill()  # no transfer may outlive the daemon's interest in its slot
        reply = waiter.reply
        if reply is None:
            if link.process.returncode is None and self._link is link:
                raise TimedOutError(f"the NIXL exporter of {self.label} did not answer a pull")
            raise ExporterUnavailableError(f"the NIXL exporter of {self.label} died in a pull")
        if reply.errno:
            raise error_from_errno(reply.errno, reply.message)

    async def start(self) -> None:
        """Start an exporter and wait for it to be ready; raises
        :class:`~kvtierd.nixl.agent.TransferError` saying why it could not start (it is then
        killed)."""
        self.generation += 1
        agent = f"{self._prefix}-r{self.region.id}-{self.generation}"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = await anyio.open_process(
                self._command(agent, theirs.fileno()),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # NIXL logs INFO lines to stdout
                stderr=subprocess.PIPE,  # relayed to the daemon's log, never its log file
                pass_fds=(self.region.fd, self._landing_fd, theirs.fileno()),
                env=exporter_environment(child_environment()),
                start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            raise TransferError(f"cannot start the NIXL exporter of {self.label}: {exc}") from exc
        finally:
            theirs.close()
        stream = await anyio.abc.UNIXSocketStream.from_socket(ours)
        link = _Link(process, stream, Ready("", 0, 0, b""), self.label)
        try:
            link.ready = await self._first_ready(stream)
        except BaseException as exc:
            how = await link.aclose()
            if isinstance(exc, KvtierError | TimeoutError):
                raise TransferError(
                    f"the NIXL exporter of {self.label} did not start ({how}): {exc}"
                ) from exc
            raise
        if link.ready.size_bytes != self.region.size_bytes:
            await link.aclose()
            raise TransferError(f"the NIXL exporter of {self.label} registered another size")
        self._link = link
        self._why_down = ""

    def _command(self, agent: str, control_fd: int) -> list[str]:
        return [
            sys.executable, "-m", "kvtierd.nixl.exporter",
            "--region-fd", str(self.region.fd), "--landing-fd", str(self._landing_fd),
            "--control-fd", str(control_fd), "--size-bytes", str(self.region.size_bytes),
            "--landing-bytes", str(LANDING_SLOTS * self.landing_slot_bytes),
            "--agent", agent, "--user", self.user,
            "--region", str(self.region.id), "--tenant", self.region.tenant or "default",
        ]  # fmt: skip

    async def _first_ready(self, stream: anyio.abc.SocketStream) -> Ready:
        decoder: FrameDecoder[FromExporter] = FrameDecoder(FromExporter)
        with anyio.fail_after(self._start_timeout_s):
            while True:
                try:
                    data = await stream.receive(_RECEIVE_BYTES)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    raise RemoteProtocolError("it ended before it was ready") from None
                messages = decoder.feed(data)
                if messages:
                    if not isinstance(messages[0], Ready) or len(messages) > 1:
                        raise RemoteProtocolError("its first message was not Ready alone")
                    return messages[0]

    async def supervise(self) -> NoReturn:
        """Serve the running exporter; when it dies, say so once and start another after the
        back-off, again and again; until cancelled, which kills the one running."""
        delay = 0.0
        try:
            while True:
                link = self._link
                if link is not None:
                    how = await self._serve(link)
                    delay = self._backoff.died(time.monotonic() - link.started_at)
                    log.warning("NIXL exporter of %s %s: its readers lose their transfers; "
                                "restarting it in %.1f s", self.label, how, delay)  # fmt: skip
                await anyio.sleep(delay)
                try:
                    await self.start()
                except TransferError as exc:
                    delay = self._backoff.died(0.0)
                    self._why_down = f"{exc}; trying again"
                    log.debug("%s (next try in %.1f s)", exc, delay)
                    continue
                assert self._link is not None
                log.info("NIXL exporter of %s is back, pid %d, agent %s", self.label,
                         self._link.process.pid, self._link.ready.agent)  # fmt: skip
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Kill the running exporter, if any; pulls awaiting it fail. Idempotent."""
        link, self._link = self._link, None
        self._why_down = "the daemon is stopping"
        if link is not None:
            link.fail_pending()
            await link.aclose()

    async def _serve(self, link: _Link) -> str:
        """Answer ``link``'s replies and stir it until its control socket closes or it breaks
        the protocol; then reap it and say how it ended."""
        why = ""
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._stir, link)
            tasks.start_soon(link.relay_stderr)
            decoder: FrameDecoder[FromExporter] = FrameDecoder(FromExporter)
            while True:
                try:
                    data = await link.stream.receive(_RECEIVE_BYTES)
                    messages = decoder.feed(data)
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    break
                except RemoteProtocolError as exc:
                    why = f" after it broke the control protocol ({exc})"
                    break
                for message in messages:
                    if not isinstance(message, Pulled):
                        continue  # (a second Ready: nothing to do)
                    waiter = link.pending.get(message.id)
                    if waiter is not None:
                        waiter.reply = message
                        waiter.done.set()
            tasks.cancel_scope.cancel()
        self._link = None
        self._why_down = f"the NIXL exporter of {self.label} ended; restarting"
        link.fail_pending()
        how = await link.aclose() + why
        self._why_down = f"the NIXL exporter of {self.label} {how}; restarting"
        return how

    async def _stir(self, link: _Link) -> None:
        """Stir the exporter when woken (a grant, a lease) and every :data:`STIR_EVERY_S`
        while a lease is held; a stir less than that after the last is not needed (the
        exporter lingers longer)."""
        if self._held:
            self._wake.set()
        last = float("-inf")
        with contextlib.suppress(ExporterUnavailableError):
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                while True:
                    if time.monotonic() - last >= STIR_EVERY_S:
                        await link.send(Stir())
                        last = time.monotonic()
                    if not self._held:
                        break
                    await anyio.sleep(STIR_EVERY_S)

    def _ready(self) -> Ready:
        return self._require().ready

    def _require(self) -> _Link:
        link = self._link
        if link is None:
            raise ExporterUnavailableError(self._why_down or f"{self.label} has no exporter")
        return link


def _landing_file(name: str, size_bytes: int) -> tuple[int, mmap.mmap]:
    """A memory file of ``size_bytes`` sealed against resizing (an exporter that truncated it
    would make the daemon's copy fault), and the daemon's read-only mapping of it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)  # fmt: skip
        return fd, mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except BaseException:
        os.close(fd)
        raise


def check_extents(region: TenantRegion, extents: list[Extent]) -> list[Extent]:
    """``extents`` (arena offsets and lengths, as the store's slots give them) as offsets in
    ``region``; :class:`~kvtierd.errors.InvalidRequestError` for any not wholly inside it."""
    relative = []
    for offset, length in extents:
        start = region.relative(offset)
        if start < 0 or length <= 0 or start + length > region.size_bytes:
            raise InvalidRequestError(
                f"{length} bytes at arena offset {offset} are outside region {region.id}"
            )
        relative.append((start, length))
    return relative
