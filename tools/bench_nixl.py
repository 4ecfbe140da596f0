"""Benchmark of NIXL reads (issue 19): kvtierd's NIXL pull against a raw NIXL READ of the same
buffers (the limit) and against the remote path kvtierd has without NIXL, the pool restore.

Per block size (2 MiB and 32 MiB by default, ``--total`` bytes of blocks each), in one run:

* *pull*: a real daemon with ``[nixl] enabled = true`` holds the blocks in DRAM (written through
  the ordinary client); a reader process with its own NIXL agent
  (:class:`kvtierd.client.nixl.NixlReader`) leases every block with one READ_NIXL, pulls them
  into a registered, pre-faulted buffer and lets the reader re-check them (lease and checksums),
  then releases: one round. Timed from the lease to the release; the lease round trip and the
  transfer with its check are reported apart, and the checksum alone is timed after the round.
* *bare*: the pull's round with the transfer made by the reader's agent alone
  (:meth:`~kvtierd.nixl.agent.NixlAgent.pull` of the lease's descriptors, no re-check): what
  the lease and the daemon's side cost against *raw*, and the re-check against *pull*.
* *raw*: two processes and no daemon: an owner registers a memfd of the same bytes (as the
  daemon's arena is) with kvtierd's :class:`~kvtierd.nixl.agent.NixlAgent` and hands over its
  metadata; a puller on ``nixl._api`` alone reads the same number of buffers of the same size
  into a registered buffer, one ``initialize_xfer`` + ``transfer`` per round, polling
  ``check_xfer_state`` with kvtierd's back-off: what NIXL gives, same UCX transport.
* *pool*: the remote path without NIXL, measured as ``tools/bench_pool.py`` measures restore
  (its helpers): a daemon attached to a real ``redis-server`` (write-through, plaintext, no
  NVMe tier; on loopback, or on a host of its own) stores the same blocks; every round it is
  stopped, its data directory wiped and it is started again (it indexes the blocks from its
  manifest in the pool), then a client leases every block with 1-key READs
  (``--pool-concurrency`` in flight, at most :data:`POOL_IN_FLIGHT_BYTES`), so every byte comes
  from the pool. The blocks end leased in the daemon's DRAM, not copied into the client's
  buffer: the pull does more work than this side.

The first pull and the first raw READ (a new connection, the grant and its metadata loaded) are
reported on their own as *cold*; then every one of ``--rounds`` rounds runs the pull, bare and
raw sides ``--repeats`` times over, in an order rotating every time (A B C, B C A, ...), so
that they share the moments of a loaded machine (memory bandwidth swings 2x within seconds on
these VMs), and then one pool restore (seconds: a daemon restart).
Ratios are medians of per-round ratios: pull / raw (goal >= 0.9) and pull / pool (goal >= 2 for
2 MiB blocks).

Progress threads. NIXL's Python layer gives an agent a progress thread that busy-waits a core
for the agent's whole life (``pthrDelay`` 0). The daemon loads no NIXL: each tenant region is
exported by a process of its own (issue 31, ``docs/nixl.md``), whose agent has none ("No
spinning core": it drives UCX's progress on its event loop while a NIXL lease of the region is
held and 5 s after), and both pullers, the reader and the raw puller, are made without one
(``progress_thread=False``): they only pull, and drive their transfers by polling them, so idle
they use nothing and are never stopped. The raw owner keeps NIXL's defaults, thread included:
plain NIXL as a user runs it, the limit; it spins, so it is stopped (SIGSTOP, then SIGCONT)
while the pull, bare and pool sides run. The daemon and its exporters idle at 0% of a core, but
in the 5 s after a lease the exporter's progress pump runs, and the raw side follows a pull
within those 5 s: so the daemon and its exporters are stopped while the raw and pool sides
run. On 2 vCPUs a side measured beside a spinning process would lose a core to it. Recorded:
the idle CPU of the daemon with its exporters, of the owner and of the pool's daemon, and the
daemon's with its exporters in the 2 s after a lease (``nixl_daemon_linger_cpu``);
``--keep-others-running`` measures without stopping anyone.

*Placement* says where the processes run. ``local``: every process on this host, the reader
reaching the daemon's Unix socket, UCX's transports as ``UCX_TLS`` says (the benchmark leaves it
as it finds it: unset, UCX's defaults, take ``cma`` between two processes of one host).
``netns``: three network namespaces on one bridge (``kvtierd/testing/netns.py``'s
:class:`~kvtierd.testing.netns.NetnsLab`), every one of them reached through its own veth pair:
the NIXL daemon and the raw owner on the first, the reader, the raw puller and the pool's
restoring daemon on the second, ``redis-server`` on the third. The reader opens the daemon over
TCP with TLS (``remote.listen``, a client certificate made with ``trustme``, ``docs/remote.md``)
and pulls exactly as locally; every NIXL process runs with ``UCX_TLS=tcp``, so the bytes cross
the veth pair (without it UCX may take ``cma`` between namespaces of one machine), and the
bytes the second host's ``eth0`` received while each side ran are recorded beside the bytes it
pulled. The pool side is the remote path of a daemon only the pool can feed: its restore GETs
cross from the third host to the second. The bench process writes the blocks through the
daemons' Unix sockets (files, reachable from any namespace) and takes the pool daemon's leases
through its socket. ``netns`` needs root, ``ip`` and ``trustme``; without them it stops with
the reason before anything starts. Which transport UCX chose for the RMA reads of the reader
and of the puller is recorded (``UCX_PROTO_INFO=y`` in the children).

NIXL never enters this process (every process that loaded it must end through
:func:`kvtierd.nixl.agent.exit_process`): the reader, owner and puller are children running
this file with ``--child``, driven line by line over stdin and answering one JSON line each.
That is why the children's code lives here rather than in a module of its own, and the reason
this file runs past 600 lines.

A full run rewrites the "nixl" section of ``docs/benchmarks.md`` with its plot and stores the
JSON in ``docs/benchmarks/nixl.json``; ``--no-record``, ``--quick`` or other sizes or totals
leave docs/ alone. Everything else is written under a temporary directory in /tmp, removed at
the end.

Run: ``python -m tools.bench_nixl --json`` (both placements, ``local,netns``: under 4 minutes on
2 vCPUs; ``--quick``: about 1; ``--placements local`` where namespaces cannot be made).
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import importlib.util
import json
import mmap
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import anyio
import numpy as np

from kvtierd import config
from kvtierd.client import Client, chain_keys, client_tls_context, connect, connect_tcp
from kvtierd.nixl.agent import POLL_FIRST_S, POLL_MAX_S
from kvtierd.testing import DaemonProcess
from tools import benchlib
from tools.benchlib import log, size_name
from tools.poolrig import daemon_read as pool_read
from tools.poolrig import pool_config, redis_server, restart_wiped

if TYPE_CHECKING:
    from kvtierd.client.nixl import NixlLease
    from kvtierd.nixl.agent import NixlAgent

MiB = 1 << 20
NAME = "nixl"
DEFAULT_SIZES = "2M,32M"
DEFAULT_PLACEMENTS = "local,netns"
DEFAULT_TOTAL, QUICK_TOTAL = "256M", "16M"
DEFAULT_ROUNDS, QUICK_ROUNDS = 7, 2
DEFAULT_REPEATS = 3
GOAL_PULL_OVER_RAW = 0.9
GOAL_PULL_OVER_POOL = 2.0
GOAL_POOL_BLOCK_BYTES = 2 * MiB
NIXL_SIDES = ("pull", "bare", "raw")
SIDES = (*NIXL_SIDES, "pool")
#: The ratios of every round (numerator, denominator): the pull against the limit, against the
#: same lease and transfer without the reader's re-check ("bare"), and against the pool restore.
RATIOS = (("pull", "raw"), ("bare", "raw"), ("pull", "bare"), ("pull", "pool"))
#: The namespace ``tools/bench_pool.py``'s restore reads.
POOL_NS = "bench"
#: At most this many bytes of blocks in flight from the pool, and a per-command timeout for
#: the daemon's pool client above its default (5 s): on 2 loaded vCPUs 16 GETs of 32 MiB from
#: one ``redis-server`` outlast the default.
POOL_IN_FLIGHT_BYTES = 64 * MiB
POOL_TIMEOUT_S = 30.0
#: How long a daemon's idle CPU is sampled.
IDLE_SAMPLE_S = 2.0
#: The longest wait for one answer of a child (a start of Python and NIXL included).
CHILD_TIMEOUT_S = 120.0
#: How long one raw READ may take before the puller gives up, and its polls' back-off (that of
#: ``kvtierd.nixl.agent``).
RAW_TIMEOUT_S = 60.0
RAW_POLL_FIRST_S, RAW_POLL_MAX_S = POLL_FIRST_S, POLL_MAX_S
#: ``netns``: the daemon's TCP control port (on its host's address), the common name of the
#: reader's certificate and the uid the daemon maps it to (in tenant ``default``'s uids), the
#: transports of every NIXL process.
REMOTE_PORT = 7460
READER_NAME, READER_UID = "bench-reader", 2001
NETNS_UCX_TLS = "tcp"
UCX_TLS_UNSET = "unset (UCX's defaults)"


# -- placements --------------------------------------------------------------------------------


class Placement(enum.Enum):
    LOCAL = "local"
    NETNS = "netns"


def placement_unavailable(placement: Placement) -> str | None:
    """Why ``placement`` cannot be measured here, or ``None``; asks nothing of NIXL."""
    if placement is Placement.NETNS:
        from kvtierd.testing.netns import netns_available

        reason = netns_available()
        if reason is not None:
            return f"placement 'netns' needs network namespaces: {reason}"
        if importlib.util.find_spec("trustme") is None:
            return "placement 'netns' needs trustme for its TLS certificates (the test extra)"
    return None


@dataclass(frozen=True)
class RemoteAccess:
    """The NIXL daemon's TCP control endpoint (``remote.listen`` with TLS) and the directory of
    its certificates (``ca.pem``, ``server.pem``, the reader's ``reader.pem``)."""

    address: str
    port: int
    tls: Path

    @property
    def endpoint(self) -> str:
        return f"tls://{self.address}:{self.port}"

    def daemon_config(self) -> str:
        """``[remote]``, admitting the reader's certificate as :data:`READER_UID`, and the one
        tenant that uid may use (``default``, where the blocks are written: all of the DRAM)."""
        return (
            f'[remote]\nlisten = "{self.address}:{self.port}"\n'
            f'cert_file = "{self.tls / "server.pem"}"\nkey_file = "{self.tls / "server.pem"}"\n'
            f'ca_file = "{self.tls / "ca.pem"}"\n'
            f'clients = [{{name = "{READER_NAME}", uid = {READER_UID}}}]\n\n'
            f'[[tenants]]\nname = "default"\nuids = [{READER_UID}]\n'
        )


def make_certificates(directory: Path, server_address: str) -> Path:
    """A CA, the daemon's certificate for ``server_address`` and the reader's (common name
    :data:`READER_NAME`), in ``directory``, which is returned."""
    import trustme

    directory.mkdir(parents=True)
    ca = trustme.CA()
    ca.cert_pem.write_to_path(directory / "ca.pem")
    server = ca.issue_cert(server_address)
    server.private_key_and_cert_chain_pem.write_to_path(directory / "server.pem")
    reader = ca.issue_cert(f"{READER_NAME}.clients", common_name=READER_NAME)
    reader.private_key_and_cert_chain_pem.write_to_path(directory / "reader.pem")
    return directory


@dataclass(frozen=True)
class Hosts:
    """Where each process of one placement runs and how they meet: a command prefix per role
    (``ip netns exec NAME env UCX_TLS=tcp`` in a namespace; empty on this host), the pool's
    address, the daemon's TCP endpoint when the reader is on another host (else its Unix
    socket), and the bytes the reader's host received so far (``None``: no link to count)."""

    pool: tuple[str, int]
    ucx_tls: str
    daemon: Sequence[str] = ()
    owner: Sequence[str] = ()
    reader: Sequence[str] = ()
    puller: Sequence[str] = ()
    pool_daemon: Sequence[str] = ()
    remote: RemoteAccess | None = None
    reader_rx_bytes: Callable[[], int] | None = None


@contextlib.contextmanager
def open_placement(placement: Placement, workdir: Path) -> Iterator[Hosts]:
    """The hosts of ``placement`` with a ``redis-server`` for the pool side, torn down on the way
    out (``netns``: the namespaces and whatever still runs in them). Check
    :func:`placement_unavailable` first."""
    if placement is Placement.LOCAL:
        with redis_server(workdir / "redis") as port:
            yield Hosts(
                pool=("127.0.0.1", port), ucx_tls=os.environ.get("UCX_TLS") or UCX_TLS_UNSET
            )
        return
    from kvtierd.testing.netns import NetnsLab

    with NetnsLab(workdir / "lab", hosts=3) as lab:
        holder, reader, pool = lab.hosts
        tcp = ["env", f"UCX_TLS={NETNS_UCX_TLS}"]
        remote = RemoteAccess(
            holder.address, REMOTE_PORT, make_certificates(workdir / "tls", holder.address)
        )
        with pool.redis_server(workdir / "redis", persistence=False) as redis:
            yield Hosts(
                pool=(pool.address, redis.port),
                ucx_tls=NETNS_UCX_TLS,
                daemon=holder.command(tcp),
                owner=holder.command(tcp),
                reader=reader.command(tcp),
                puller=reader.command(tcp),
                pool_daemon=reader.command_prefix,
                remote=remote,
                reader_rx_bytes=lambda: reader.link_stats()["rx_bytes"],
            )


# -- the children (NIXL is loaded only there) --------------------------------------------------


def _say(line: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def _commands() -> Iterator[str]:
    """The parent's commands, one a line, until ``exit`` or the end of stdin."""
    for line in sys.stdin:
        command = line.strip()
        if command == "exit":
            return
        yield command


def _touched(nbytes: int) -> mmap.mmap:
    """Anonymous, page-aligned memory with every page faulted in (first touch is slow here)."""
    memory = mmap.mmap(-1, nbytes)
    np.frombuffer(memory, np.uint8)[:] = 1
    return memory


def _memfd(name: str, nbytes: int) -> mmap.mmap:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _reader(endpoint: str, tls: str, ns_name: str, block_text: str, count_text: str) -> None:
    """kvtierd's pull: answers ``pull`` with the timings of one lease + pull + release, and
    ``bare`` with those of the same round with the pull done by the agent alone (no check).
    ``endpoint`` is the daemon's Unix socket or ``tls://HOST:PORT`` (the CA and the reader's
    certificate in directory ``tls``)."""
    from kvtierd.client.nixl import NixlReader
    from kvtierd.nixl.agent import NixlAgent
    from kvtierd.store.records import checksum

    block_bytes, count = int(block_text), int(count_text)
    started = time.perf_counter()
    agent = NixlAgent(f"bench-reader-{os.getpid()}", progress_thread=False)  # it only pulls
    with _client(endpoint, tls) as client, NixlReader(client, agent) as reader:
        memory = reader.register(_touched(count * block_bytes))
        buffers = [memory[i * block_bytes : (i + 1) * block_bytes] for i in range(count)]
        ns = client.namespace(ns_name, block_bytes=block_bytes)
        keys = chain_keys(range(count), 1, ns.key_salt)
        _say({"ready_s": time.perf_counter() - started})
        for command in _commands():
            t0 = time.perf_counter()
            lease = reader.lease(ns, keys)
            try:
                t1 = time.perf_counter()
                if command == "bare":
                    moved = _bare_pull(agent, lease, buffers, reader.timeout_s)
                else:
                    moved = reader.pull(lease, buffers)
                t2 = time.perf_counter()
            finally:
                lease.release()
            t3 = time.perf_counter()
            for buffer in buffers:  # the check pull makes, timed alone
                checksum(buffer)
            verify_s = time.perf_counter() - t3
            _say({"s": t3 - t0, "lease_s": t1 - t0, "pull_s": t2 - t1, "verify_s": verify_s,
                  "bytes": moved})  # fmt: skip
    agent.close()


def _client(endpoint: str, tls: str) -> Client:
    """A client of the daemon at ``endpoint`` (see :func:`_reader`)."""
    scheme, _, address = endpoint.partition("://")
    if scheme != "tls":
        return connect(endpoint)
    host, _, port = address.rpartition(":")
    pem = os.path.join(tls, "reader.pem")
    context = client_tls_context(os.path.join(tls, "ca.pem"), pem, pem)
    return connect_tcp(host, int(port), tls=context)


def _bare_pull(
    agent: NixlAgent, lease: NixlLease, buffers: Sequence[memoryview], timeout_s: float
) -> int:
    """``lease``'s blocks pulled into ``buffers`` by the agent alone, as
    :meth:`~kvtierd.client.nixl.NixlReader.pull` pulls them but without its re-check."""
    from kvtierd.io.buffers import buffer_address

    start = 0
    for reply in lease.replies:
        parts = buffers[start : start + len(reply.extents)]
        local = [(buffer_address(b), e.length) for b, e in zip(parts, reply.extents, strict=True)]
        agent.pull(lease.peer, reply.descriptors, local, timeout_s=timeout_s)
        start += len(reply.extents)
    return sum(lease.lengths)


def _owner(directory: str, block_text: str, count_text: str) -> None:
    """The raw READ's owner: a memfd of random bytes registered, its metadata and extents in
    ``directory``; serves until ``exit``. Its agent has NIXL's defaults, the progress thread
    (which answers the puller's reads over TCP) included."""
    from kvtierd.nixl.agent import NixlAgent
    from kvtierd.store.records import checksum

    block_bytes, count = int(block_text), int(count_text)
    nbytes = block_bytes * count
    started = time.perf_counter()
    region = _memfd("kvtierd-bench-owner", nbytes)
    view = memoryview(region)
    view[:] = np.random.default_rng(19).bytes(nbytes)
    base = int(np.frombuffer(region, np.uint8).ctypes.data)
    out = Path(directory)
    with NixlAgent(f"bench-owner-{os.getpid()}") as agent:
        registration = agent.register(base, nbytes)
        (out / "owner.md").write_bytes(agent.metadata(registration))
        extents = [(base + i * block_bytes, block_bytes) for i in range(count)]
        (out / "extents.json").write_text(json.dumps(extents))
        (out / "checksum").write_text(str(checksum(view)))
        _say({"ready_s": time.perf_counter() - started})
        for _ in _commands():
            pass


def _puller(directory: str, block_text: str, count_text: str) -> None:
    """The raw READ on ``nixl._api`` alone: answers ``round`` with the time of one READ of every
    extent, the descriptor lists built once, ``check_xfer_state`` polled with the back-off of
    kvtierd's agent; no progress thread, as the reader's agent (polling drives its transfers)."""
    from nixl._api import nixl_agent, nixl_agent_config

    from kvtierd.store.records import checksum

    block_bytes, count = int(block_text), int(count_text)
    nbytes = block_bytes * count
    source = Path(directory)
    started = time.perf_counter()
    settings = nixl_agent_config(enable_prog_thread=False, backends=[])  # it only pulls
    agent = nixl_agent(f"bench-puller-{os.getpid()}", settings)
    agent.create_backend("UCX", {})
    memory = _touched(nbytes)
    base = int(np.frombuffer(memory, np.uint8).ctypes.data)
    registered = agent.register_memory([(base, nbytes, 0, "")], "DRAM")
    peer = agent.add_remote_agent((source / "owner.md").read_bytes())
    peer = peer.decode() if isinstance(peer, bytes) else str(peer)
    extents = json.loads((source / "extents.json").read_text())
    remote = agent.get_xfer_descs([(a, n, 0) for a, n in extents], "DRAM")
    local = agent.get_xfer_descs([(base + i * block_bytes, block_bytes, 0) for i in range(count)],
                                 "DRAM")  # fmt: skip
    expected = int((source / "checksum").read_text())
    _say({"ready_s": time.perf_counter() - started})
    for _ in _commands():
        memory[:1] = b"\0"  # a READ that did nothing would not pass the check below
        pause = RAW_POLL_FIRST_S
        t0 = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, remote, peer)
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            if time.perf_counter() - t0 > RAW_TIMEOUT_S:
                raise RuntimeError(f"raw NIXL READ not done in {RAW_TIMEOUT_S:g} s")
            time.sleep(pause)
            pause = min(2 * pause, RAW_POLL_MAX_S)
            state = agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - t0
        handle.release()
        if state == "ERR":
            raise RuntimeError("raw NIXL READ failed (ERR)")
        if checksum(memoryview(memory)) != expected:
            raise RuntimeError("raw NIXL READ brought other bytes")
        _say({"s": elapsed, "bytes": nbytes})
    agent.remove_remote_agent(peer)
    agent.deregister_memory(registered)


CHILD_ROLES: dict[str, Callable[..., None]] = {
    "reader": _reader,
    "owner": _owner,
    "puller": _puller,
}


def child_main(role: str, args: Sequence[str]) -> None:
    """Run one child role and end the process through ``exit_process`` (never through the
    interpreter's shutdown, which crashes once NIXL is loaded); a failure is answered as
    ``{"error": ...}``."""
    from kvtierd.nixl.agent import exit_process

    try:
        CHILD_ROLES[role](*args)
    except BaseException as exc:
        _say({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        exit_process(1)
    exit_process(0)


#: A row of a UCX protocol table (``UCX_PROTO_INFO=y``): ``| 0..inf | zero-copy | cma/memory |``.
_PROTO_ROW = re.compile(r"^[^|]*\|\s*[0-9.]+(?:inf)?\s*\|[^|]+\|\s*([^|]+?)\s*\|\s*$")


class Child:
    """A child of this file in ``role``, run under ``prefix``; its stdout read line by line by a
    thread (NIXL logs there too: an answer is a line starting with ``{``; UCX prints there the
    protocols it chose, asked to with ``UCX_PROTO_INFO``), its stderr kept in ``log_path``."""

    def __init__(self, role: str, *args: str, prefix: Sequence[str], log_path: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", UCX_PROTO_INFO="y")
        root = str(benchlib.ROOT)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.role = role
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115  (closed by close())
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tools.bench_nixl", "--child", role, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=root,
            env=env,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        #: What UCX chose for this child's RMA reads (its ``UCX_PROTO_INFO`` tables).
        self.read_transports: set[str] = set()
        self._thread = threading.Thread(target=self._read, args=(self.process.stdout,))
        self._thread.daemon = True
        self._thread.start()

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        in_read_table = False
        for line in stream:
            if line.startswith("{"):
                self._lines.put(line)
            elif " by ucp_" in line:  # the title of one of UCX's protocol tables
                in_read_table = "remote memory read by" in line
            elif in_read_table and (row := _PROTO_ROW.search(line)):
                self.read_transports.add(row.group(1))
        self._lines.put("")

    def answer(self) -> dict[str, Any]:
        """The child's next JSON line; raises ``RuntimeError`` when it failed, ended or said
        nothing for :data:`CHILD_TIMEOUT_S`."""
        try:
            line = self._lines.get(timeout=CHILD_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"the {self.role} said nothing in {CHILD_TIMEOUT_S:g} s") from None
        if not line:
            self.process.wait(10)
            raise RuntimeError(
                f"the {self.role} ended ({self.process.returncode}): {self._stderr_tail()}"
            )
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the {self.role} failed: {answer['traceback']}")
        return answer

    def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.answer()

    def close(self) -> None:
        """Tell the child to exit and check that it exited 0 (139 would be NIXL's crash at
        interpreter exit)."""
        assert self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.write("exit\n")
            self.process.stdin.close()
        try:
            code = self.process.wait(CHILD_TIMEOUT_S)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self._thread.join(10)
            self._log.close()
        if code != 0:
            raise RuntimeError(f"the {self.role} exited with {code}: {self._stderr_tail()}")

    def kill(self) -> None:
        """End the child now (a measurement failed); never raises for the child."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        self._thread.join(10)
        self._log.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        """Close (checking the exit status) after success; kill after a failure, which
        propagates."""
        if kind is None:
            self.close()
        else:
            self.kill()

    def _stderr_tail(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]


# -- the sides ---------------------------------------------------------------------------------


def nixl_daemon_config(hosts: Hosts) -> str:
    """NIXL reads on, and the TCP control endpoint when the reader is on another host."""
    text = "[nixl]\nenabled = true\n"
    return text if hosts.remote is None else f"{text}\n{hosts.remote.daemon_config()}"


def check_nixl_exported(daemon: DaemonProcess) -> None:
    """Raise with the daemon's reason unless it exported its regions over NIXL."""
    text = daemon.log()
    if "exported by" not in text:
        reason = next((ln for ln in text.splitlines() if "NIXL reads are off" in ln), text[-800:])
        raise RuntimeError(f"the daemon did not export its arena over NIXL: {reason}")


def write_blocks(socket: Path, ns_name: str, block_bytes: int, count: int) -> list[bytes]:
    """``count`` blocks of random bytes into namespace ``ns_name``; their keys."""
    rng = np.random.default_rng(block_bytes)
    blocks = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(min(count, 4))]
    with connect(socket) as client:
        ns = client.namespace(ns_name, block_bytes=block_bytes)
        keys = chain_keys(range(count), 1, ns.key_salt)
        step = max(1, min(64, (64 * MiB) // block_bytes))
        for i in range(0, count, step):
            chunk = keys[i : i + step]
            ns.put(chunk, [blocks[(i + j) % len(blocks)] for j in range(len(chunk))])
    return keys


def pool_round(
    daemon: DaemonProcess, block_bytes: int, keys: list[bytes], concurrency: int
) -> dict[str, Any]:
    """One pool restore (``tools/bench_pool.py``'s): restart on a wiped data directory, then
    lease every block of namespace :data:`POOL_NS` from the pool."""
    restart_s = restart_wiped(daemon)
    with connect(daemon.socket) as client:
        status = client.pool_status()
    if status["state"] != "attached" or status["restored"] != len(keys):
        raise RuntimeError(f"the restarted daemon did not restore: {status}")
    gbps, latencies = anyio.run(pool_read, daemon.socket, block_bytes, keys, concurrency, 1)
    with connect(daemon.socket) as client:
        hits = client.pool_status()["pool_hits"]
    if hits < len(keys):
        raise RuntimeError(f"{hits} pool hits for {len(keys)} blocks: not every block came from it")
    nbytes = len(keys) * block_bytes
    return {
        "s": nbytes / gbps / 1e9,
        "gbps": gbps,
        "restart_s": restart_s,
        "p50_ms": benchlib.percentile(latencies, 50) * 1e3,
        "p99_ms": benchlib.percentile(latencies, 99) * 1e3,
    }


def dram_size(nbytes: int) -> str:
    """DRAM for a daemon that must lease ``nbytes`` of blocks on one connection at once: the
    default ``limits.connection_pinned_share`` (0.75) of its region, with room to spare."""
    return f"{(2 * nbytes + 64 * MiB) >> 20}M"


@contextlib.contextmanager
def pool_with_blocks(
    hosts: Hosts, where: Path, block_bytes: int, count: int
) -> Iterator[tuple[DaemonProcess, list[bytes], float]]:
    """A daemon on the reader's host attached to the pool that wrote ``count`` blocks through to
    it, their keys and its idle CPU (share of a core); on the way out it stops and its values
    leave the pool."""
    prefix = f"bench-nixl-{block_bytes // MiB}m"
    address, port = hosts.pool
    # tools/bench_pool.py's configuration, with the pool at its placement's address
    text = pool_config(port, prefix).replace(f"//127.0.0.1:{port}", f"//{address}:{port}")
    daemon = DaemonProcess(
        where / "pool-daemon",
        dram_size=dram_size(count * block_bytes),
        nvme_size="0",  # pool -> DRAM only, as in tools/bench_pool.py
        config_text=text + f"timeout_s = {POOL_TIMEOUT_S}\n",
        command_prefix=hosts.pool_daemon,
    )
    try:
        restart_wiped(daemon)
        keys = write_blocks(daemon.socket, POOL_NS, block_bytes, count)
        with connect(daemon.socket) as client:
            written = client.pool_status()["written"]
        if written != count:
            raise RuntimeError(f"only {written} of {count} blocks reached the pool")
        yield daemon, keys, cpu_share(_pid(daemon), IDLE_SAMPLE_S)
    finally:
        if daemon.running:
            daemon.stop()
        _drop_pool_keys(hosts.pool, prefix)


def _drop_pool_keys(pool: tuple[str, int], prefix: str) -> None:
    """Values, manifest, consensus: leave nothing of ``prefix`` in the pool."""
    import redis

    with redis.Redis(host=pool[0], port=pool[1]) as raw:
        leftovers = list(raw.scan_iter(match=f"{prefix}:*".encode(), count=1000))
        for i in range(0, len(leftovers), 256):
            raw.delete(*leftovers[i : i + 256])


def pool_in_flight(block_bytes: int, concurrency: int) -> int:
    """READs in flight on the pool side: ``concurrency``, but no more than
    :data:`POOL_IN_FLIGHT_BYTES` of blocks (the daemon's pool reads share one server)."""
    return max(1, min(concurrency, POOL_IN_FLIGHT_BYTES // block_bytes))


def _rotated(sides: Sequence[str], n: int) -> list[str]:
    k = n % len(sides)
    return [*sides[k:], *sides[:k]]


def run_rounds(
    measure: dict[str, Callable[[], dict[str, Any]]], rounds: int, repeats: int
) -> list[dict[str, Any]]:
    """``rounds`` rounds: in each, the NIXL sides ``repeats`` times over, in an order rotating
    every time, then one pool restore (it restarts a daemon: seconds). A NIXL side's figures in
    a round are the medians of its repeats."""
    out = []
    for n in range(rounds):
        samples: dict[str, list[dict[str, Any]]] = {side: [] for side in NIXL_SIDES}
        for k in range(repeats):
            for side in _rotated(NIXL_SIDES, n * repeats + k):
                samples[side].append(measure[side]())
        row: dict[str, Any] = {side: _median_fields(samples[side]) for side in NIXL_SIDES}
        row["pool"] = measure["pool"]()
        for a, b in RATIOS:
            row[f"{a}_over_{b}"] = row[a]["gbps"] / row[b]["gbps"]
        out.append(row)
        rates = ", ".join(f"{side} {row[side]['gbps']:.2f}" for side in SIDES)
        ratios = ", ".join(f"{a}/{b} {row[f'{a}_over_{b}']:.2f}" for a, b in RATIOS)
        log(f"  round {n + 1}: {rates} GB/s; {ratios}")
    return out


def _median_fields(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Field by field, the median of ``samples`` (dictionaries of numbers)."""
    return {k: benchlib.median([x[k] for x in samples]) for k in samples[0]}


@contextlib.contextmanager
def stopped(pids: Iterable[int]) -> Iterator[None]:
    """``pids`` stopped (SIGSTOP) for the block and continued after it, whatever happens."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def family(pid: int) -> list[int]:
    """``pid`` and its children: a NIXL daemon and its exporter processes (one per region)."""
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            pids += [int(child) for child in (task / "children").read_text().split()]
    return pids


def cpu_share(pid: int, seconds: float) -> float:
    """The share of one core ``pid`` and its children used (user + system) over the next
    ``seconds``: a NIXL daemon's is its own and its exporters'."""
    pids = family(pid)

    def used() -> float:
        total = 0.0
        for one in pids:
            with contextlib.suppress(FileNotFoundError):
                fields = Path(f"/proc/{one}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    before = used()
    time.sleep(seconds)
    return (used() - before) / seconds


def bench_size(
    hosts: Hosts,
    workdir: Path,
    nixl_daemon: DaemonProcess,
    block_bytes: int,
    total_bytes: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One block size in one placement: the blocks written into both daemons while the
    children start, the cold pulls, then the rounds; every side but the raw one runs with the
    raw owner (whose progress thread spins) stopped, unless ``--keep-others-running``."""
    count = max(1, total_bytes // block_bytes)
    ns_name = f"nixl-{block_bytes // MiB}m"
    where = workdir / ns_name
    where.mkdir()
    started = time.perf_counter()
    write_blocks(nixl_daemon.socket, ns_name, block_bytes, count)
    with contextlib.ExitStack() as stack:
        shape = (str(block_bytes), str(count))

        def child(role: str, *args: str) -> Child:
            prefix = getattr(hosts, role)
            made = Child(role, *args, *shape, prefix=prefix, log_path=where / f"{role}.log")
            return stack.enter_context(made)

        remote = hosts.remote
        endpoint = str(nixl_daemon.socket) if remote is None else remote.endpoint
        reader = child("reader", endpoint, "" if remote is None else str(remote.tls), ns_name)
        owner = child("owner", str(where))
        pool_daemon, pool_keys, pool_idle = stack.enter_context(
            pool_with_blocks(hosts, where, block_bytes, count)
        )
        ready = {"reader": reader.answer()["ready_s"], "owner": owner.answer()["ready_s"]}
        puller = child("puller", str(where))  # it loads the owner's metadata
        ready["puller"] = puller.answer()["ready_s"]
        children_s = ", ".join(f"{k} {v:.1f} s" for k, v in ready.items())
        log(f"{size_name(block_bytes)}: {count} blocks in both daemons, children ready "
            f"({children_s}), {time.perf_counter() - started:.1f} s in all")  # fmt: skip
        owner_idle = cpu_share(_pid(owner), IDLE_SAMPLE_S)
        in_flight = pool_in_flight(block_bytes, args.pool_concurrency)
        runs: dict[str, Callable[[], dict[str, Any]]] = {
            "pull": lambda: _with_gbps(reader.ask("pull")),
            "bare": lambda: _with_gbps(reader.ask("bare")),
            "raw": lambda: _with_gbps(puller.ask("round")),
            "pool": lambda: pool_round(pool_daemon, block_bytes, pool_keys, in_flight),
        }
        # what spins while idle (the module docstring says why), and the sides it serves
        spinners = {
            _pid(owner): {"raw"},
            **{key: {"pull", "bare"} for key in family(_pid(nixl_daemon))},
        }
        link = LinkCount(hosts.reader_rx_bytes, count * block_bytes)

        def alone(side: str) -> Callable[[], dict[str, Any]]:
            others = [pid for pid, serves in spinners.items() if side not in serves]
            if args.keep_others_running:
                others = []

            def measured() -> dict[str, Any]:
                with link.counting(side), stopped(others):
                    return runs[side]()

            return measured

        measure = {side: alone(side) for side in SIDES}
        cold = {"pull": measure["pull"]()}
        with stopped([_pid(owner)]):
            linger = cpu_share(_pid(nixl_daemon), IDLE_SAMPLE_S)
        cold["raw"] = measure["raw"]()
        transports = {"pull": sorted(reader.read_transports), "raw": sorted(puller.read_transports)}
        log(f"  cold: pull {cold['pull']['gbps']:.2f} GB/s, raw {cold['raw']['gbps']:.2f}; "
            f"UCX's RMA reads: {transports}; idle owner {owner_idle:.0%}, "
            f"daemon after a lease {linger:.0%} of a core")  # fmt: skip
        rounds = run_rounds(measure, args.rounds, args.repeats)
    return {
        "block_bytes": block_bytes,
        "blocks": count,
        "total_bytes": count * block_bytes,
        "children_ready_s": ready,
        "pool_daemon_idle_cpu": pool_idle,
        "raw_owner_idle_cpu": owner_idle,
        "nixl_daemon_linger_cpu": linger,
        "pool_in_flight": in_flight,
        "read_transports": transports,
        "reader_link": link.record(),
        "cold": cold,
        "rounds": rounds,
        "median": _medians(rounds),
    }


class LinkCount:
    """Per side, the bytes the reader's host received (``rx_bytes`` of its ``eth0``) while the
    side ran, beside the bytes it moved; ``rx_bytes`` ``None``: no link to count (``local``)."""

    def __init__(self, rx_bytes: Callable[[], int] | None, moved_bytes: int) -> None:
        self._rx_bytes = rx_bytes
        self._moved_bytes = moved_bytes
        self._counts = {side: {"rx_bytes": 0, "moved_bytes": 0} for side in SIDES}

    @contextlib.contextmanager
    def counting(self, side: str) -> Iterator[None]:
        """Count what arrives during the block (read before and after it, outside its timing)."""
        if self._rx_bytes is None:
            yield
            return
        before = self._rx_bytes()
        yield
        self._counts[side]["rx_bytes"] += self._rx_bytes() - before
        self._counts[side]["moved_bytes"] += self._moved_bytes

    def record(self) -> dict[str, Any] | None:
        """The counts, and ``crossed``: every NIXL side received at least what it pulled."""
        if self._rx_bytes is None:
            return None
        crossed = all(self._counts[s]["rx_bytes"] >= self._counts[s]["moved_bytes"]
                      for s in NIXL_SIDES)  # fmt: skip
        return {**self._counts, "crossed": crossed}


def _pid(process: Child | DaemonProcess) -> int:
    assert process.process is not None
    return process.process.pid


def _with_gbps(answer: dict[str, Any]) -> dict[str, Any]:
    return {**answer, "gbps": answer["bytes"] / answer["s"] / 1e9}


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    med = benchlib.median
    out: dict[str, Any] = {
        **{f"{a}_over_{b}": med([r[f"{a}_over_{b}"] for r in rounds]) for a, b in RATIOS},
    }
    for side in SIDES:
        fields = [k for k, v in rounds[0][side].items() if isinstance(v, float)]
        out[side] = {k: med([r[side][k] for r in rounds]) for k in fields}
    return out


def bench_placement(
    placement: Placement, workdir: Path, sizes: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    """Every block size in ``placement``: one NIXL daemon holding every size's blocks."""
    total = int(config.parse_size(args.total))
    largest = max(max(1, total // s) * s for s in sizes)
    blocks = sum(max(1, total // s) * s for s in sizes)
    with open_placement(placement, workdir) as hosts:
        daemon = DaemonProcess(
            workdir / "nixl-daemon",
            # every size's blocks, and room to lease the largest size's on one connection
            dram_size=f"{(blocks + largest + 64 * MiB) >> 20}M",
            nvme_size="0",  # the blocks stay in DRAM: NIXL reads only DRAM
            config_text=nixl_daemon_config(hosts),
            command_prefix=hosts.daemon,
        )
        started = time.perf_counter()
        daemon.start(timeout_s=120)
        try:
            check_nixl_exported(daemon)
            log(f"{placement.value}: NIXL daemon serving ({time.perf_counter() - started:.1f} s)")
            idle = cpu_share(_pid(daemon), IDLE_SAMPLE_S)
            log(f"  the NIXL daemon, idle, uses {idle:.0%} of a core")
            rows = [bench_size(hosts, workdir, daemon, s, total, args) for s in sizes]
        finally:
            code = daemon.stop()
        if code != 0:
            raise RuntimeError(f"the NIXL daemon exited with {code}: {daemon.log()[-2000:]}")
    return {"ucx_tls": hosts.ucx_tls, "nixl_daemon_idle_cpu": idle, "sizes": rows}


# -- report ------------------------------------------------------------------------------------


def goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal of issue 19 against the measured medians (never a constant)."""
    out = []
    for placement, measured in result["placements"].items():
        for row in measured["sizes"]:
            m, size = row["median"], size_name(row["block_bytes"])
            out.append({"placement": placement, "block_bytes": row["block_bytes"],
                        "goal": f"pull / raw >= {GOAL_PULL_OVER_RAW} ({size})",
                        "measured": m["pull_over_raw"],
                        "met": m["pull_over_raw"] >= GOAL_PULL_OVER_RAW})  # fmt: skip
            if row["block_bytes"] == GOAL_POOL_BLOCK_BYTES:
                out.append({"placement": placement, "block_bytes": row["block_bytes"],
                            "goal": f"pull / pool restore >= {GOAL_PULL_OVER_POOL:g}x ({size})",
                            "measured": m["pull_over_pool"],
                            "met": m["pull_over_pool"] >= GOAL_PULL_OVER_POOL})  # fmt: skip
    return out


def plot(result: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    placements = list(result["placements"].items())
    fig, axes = plt.subplots(1, len(placements), figsize=(7.5 * len(placements), 4.4),
                             squeeze=False)  # fmt: skip
    series = [
        ("raw NIXL READ (limit)", "tab:gray", lambda r: r["median"]["raw"]["gbps"]),
        ("kvtierd lease + NIXL READ, no check", "tab:cyan", lambda r: r["median"]["bare"]["gbps"]),
        ("kvtierd NIXL pull", "tab:blue", lambda r: r["median"]["pull"]["gbps"]),
        ("kvtierd NIXL pull, cold (first)", "lightsteelblue", lambda r: r["cold"]["pull"]["gbps"]),
        ("kvtierd pool restore", "tab:purple", lambda r: r["median"]["pool"]["gbps"]),
    ]
    width = 0.8 / len(series)
    for ax, (placement, measured) in zip(axes[0], placements, strict=True):
        rows = measured["sizes"]
        for n, (label, colour, value) in enumerate(series):
            xs = [i + (n - (len(series) - 1) / 2) * width for i in range(len(rows))]
            bars = ax.bar(xs, [value(r) for r in rows], width, label=label, color=colour)
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ticks = [
            f"{size_name(r['block_bytes'])} blocks\npull/raw {r['median']['pull_over_raw']:.2f}, "
            f"pull/pool {r['median']['pull_over_pool']:.1f}x"
            for r in rows
        ]
        ax.set_xticks(range(len(rows)), ticks, fontsize=8)
        ax.set_ylabel("GB/s (median of rounds)")
        ax.set_title(f"NIXL reads, placement {placement}, UCX_TLS {measured['ucx_tls']}")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.4)  # room for the legend above the bars
        ax.legend(fontsize=8, loc="upper center", ncol=2)
    return benchlib.save_figure(fig, f"{NAME}.png")


def markdown(result: dict[str, Any], figure: str) -> str:
    return "\n".join(
        [
            "## NIXL reads (issue 19)",
            "",
            *_method_lines(result),
            "",
            *_table_lines(result),
            "",
            "| placement | goal | measured | met |",
            "|---|---|---:|---|",
            *[
                f"| {g['placement']} | {g['goal']} | {g['measured']:.2f} | "
                f"{'yes' if g['met'] else 'no'} |"
                for g in result["goals"]
            ],
            "",
            *_shortfall_lines(result),
            "",
            *_context_lines(result),
            "",
            f"![NIXL reads]({figure})",
            "",
            benchlib.machine_line(result["machine"]),
        ]
    )


def _method_lines(result: dict[str, Any]) -> list[str]:
    placements = result["placements"]
    where = {
        "local": "every process on this host, the reader on the daemon's Unix socket",
        "netns": "three network namespaces on one bridge (`kvtierd/testing/netns.py`), each "
        "behind its own veth pair: the daemon and the raw owner on the first, the reader, the "
        "raw puller and the restoring pool daemon on the second, `redis-server` on the third; "
        "the reader opens the daemon over TCP with TLS (`remote.listen`, a client "
        "certificate), the pool daemon reaches `redis-server` over the bridge",
    }
    stopped = (
        "while the pull, bare and pool sides run the raw owner is stopped (SIGSTOP), and while "
        "the raw and pool sides run the daemon and its exporters are (both spin, see below); "
        "nothing else is"
        if not result["others_running"]
        else "every process runs throughout (`--keep-others-running`)"
    )
    return [
        "`python -m tools.bench_nixl --json`: kvtierd's NIXL pull against a raw two-process NIXL "
        "READ of the same buffers (the limit) and against the pool restore (the remote path "
        f"without NIXL), {size_name(result['total_bytes'])} of blocks per block size, every "
        "process on the same 2 shared vCPUs. Placements: "
        + "; ".join(
            f"*{name}*: {where.get(name, name)}, `UCX_TLS` {m['ucx_tls']}"
            for name, m in placements.items()
        )
        + ".",
        "",
        "*Pull*: a daemon with `[nixl] enabled = true` holds the blocks in DRAM; a reader process "
        "with its own NIXL agent leases all of them with one READ_NIXL, pulls them with "
        "`NixlReader.pull` into a registered, pre-faulted buffer (which re-checks the lease and "
        "every block's xxh3 checksum) and releases them. *Raw*: an owner process registers a "
        "memfd of the same bytes, a puller on `nixl._api` alone reads the same number of "
        "buffers of the same size, one `initialize_xfer` + `transfer` per round, polled with "
        "the same back-off. *Bare*: the pull's round with the agent's READ alone "
        "(`NixlAgent.pull` of the lease's descriptors, no re-check): bare / raw is what the "
        "daemon's side and the lease cost, pull / bare what the re-check costs (pull / raw is "
        "their product). *Pool*: `tools/bench_pool.py`'s restore: a daemon attached to a "
        "`redis-server` (write-through, no NVMe tier) is restarted on a wiped data "
        "directory every round and a client leases every block from the pool, 1-key READs, "
        f"at most {result['pool_concurrency']} (and {size_name(POOL_IN_FLIGHT_BYTES)}) in flight "
        "(the blocks end leased in the daemon's DRAM, not "
        "copied into the client's buffer: this side does less than the pull). *Cold*: the first "
        "pull (and raw READ) of a new reader: connection, grant and metadata loading included. "
        f"Then {result['rounds']} rounds: in each, pull, bare and raw {result['repeats']} times "
        "over in an order rotating every time (a round's figure is the median of its repeats), "
        "then one pool restore. Ratios are medians of per-round ratios, "
        "GB/s and ms medians of rounds. *Checksum ms*: "
        "the reader's re-check (xxh3 of every block) timed alone after the round.",
        "",
        "Progress: the daemon loads no NIXL; each tenant region is exported by a process of its "
        "own (`kvtierd.nixl.exporter`, issue 31), whose agent has no NIXL progress thread (it "
        "drives UCX's progress on its event loop while a NIXL lease of the region is held and "
        "for 5 s after), nor have the two pullers' "
        "(`progress_thread=False`: they poll their transfers); the raw owner keeps NIXL's "
        "defaults, a progress thread that busy-waits a core (plain NIXL as users run it); "
        f"{stopped}.",
    ]


def _table_lines(result: dict[str, Any]) -> list[str]:
    lines = [
        "| placement | block | blocks | pull GB/s | pull cold GB/s | bare GB/s | raw GB/s | "
        "raw cold GB/s | pool restore GB/s | pull / raw per round | **pull / raw** | "
        "bare / raw | pull / bare | **pull / pool** | lease ms | pull + check ms | checksum ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for placement, measured in result["placements"].items():
        for r in measured["sizes"]:
            m, cold = r["median"], r["cold"]
            per_round = ", ".join(f"{x['pull_over_raw']:.2f}" for x in r["rounds"])
            lines.append(
                f"| {placement} | {size_name(r['block_bytes'])} | {r['blocks']} | "
                f"{m['pull']['gbps']:.2f} | {cold['pull']['gbps']:.2f} | {m['bare']['gbps']:.2f} | "
                f"{m['raw']['gbps']:.2f} | {cold['raw']['gbps']:.2f} | {m['pool']['gbps']:.2f} | "
                f"{per_round} | **{m['pull_over_raw']:.2f}** | {m['bare_over_raw']:.2f} | "
                f"{m['pull_over_bare']:.2f} | **{m['pull_over_pool']:.1f}x** | "
                f"{m['pull']['lease_s'] * 1e3:.2f} | "
                f"{m['pull']['pull_s'] * 1e3:.1f} | {m['pull']['verify_s'] * 1e3:.1f} |"
            )
    return lines


#: Why a NIXL pull over UCX's ``tcp`` transport gains little on the pool restore here.
_TCP_BOTH = (
    "both move the bytes by TCP through this one kernel (a veth pair is a memory copy, no NIC), "
    "on the same 2 vCPUs: UCX's `tcp` transport emulates the READ over one connection, which the "
    "reader's agent (no progress thread) progresses only when it polls, with kvtierd's back-off "
    f"of {POLL_FIRST_S * 1e3:g} ms doubling to {POLL_MAX_S * 1e3:g} ms, while the pool's GETs "
    "run {in_flight} at a time on connections of their own and the pool already holds the "
    "bytes (written through): the pull's advantage, "
    "RDMA's zero-copy, is not on this machine"
)


def _shortfall_lines(result: dict[str, Any]) -> list[str]:
    """Where each goal that was not met lost, from the same run's figures."""
    rows = {(g["placement"], g["block_bytes"]): g for g in result["goals"] if not g["met"]}
    lines = []
    for placement, measured in result["placements"].items():
        for r in measured["sizes"]:
            if (placement, r["block_bytes"]) not in rows:
                continue
            m, pull = r["median"], r["median"]["pull"]
            where = f"`{placement}`, {size_name(r['block_bytes'])}"
            if m["pull_over_raw"] < GOAL_PULL_OVER_RAW:
                lease, check = pull["lease_s"] / pull["s"], pull["verify_s"] / pull["s"]
                lines.append(
                    f"- {where}: pull / raw {m['pull_over_raw']:.2f}: bare / raw "
                    f"{m['bare_over_raw']:.2f} (the lease round trip is {lease:.0%} of a pull's "
                    "time: the rest is the transfer out of the daemon's exporter process "
                    "against raw's out of its owner) and pull / bare "
                    f"{m['pull_over_bare']:.2f} (the re-check; its checksum alone is {check:.0%} "
                    "of a pull's time)."
                )
            pool_goal = r["block_bytes"] == GOAL_POOL_BLOCK_BYTES
            if pool_goal and m["pull_over_pool"] < GOAL_PULL_OVER_POOL:
                tcp = any(t.startswith("tcp") for t in r["read_transports"]["pull"])
                lines.append(
                    f"- {where}: pull / pool {m['pull_over_pool']:.1f}x: the pull "
                    f"{pull['gbps']:.2f} GB/s, the pool restore {m['pool']['gbps']:.2f} GB/s "
                    "(its daemon's restart not counted)"
                    + (f"; {_TCP_BOTH.format(in_flight=r['pool_in_flight'])}." if tcp else ".")
                )
    return ["Where a goal was missed:", "", *lines] if lines else ["Every goal was met."]


def _context_lines(result: dict[str, Any]) -> list[str]:
    load = result["load_average"]
    lines = []
    for placement, measured in result["placements"].items():
        lines += [*_placement_lines(placement, measured), ""]
    return [
        *lines,
        f"One-minute load average {load['start'][0]:.1f} at the start and {load['end'][0]:.1f} "
        "at the end, on 2 vCPUs where other jobs may run too: absolute figures are this loaded "
        "machine's; compare within the run.",
    ]


def _placement_lines(placement: str, measured: dict[str, Any]) -> list[str]:
    """What UCX chose, what the idle processes used, and (``netns``) what crossed the link."""
    sizes = measured["sizes"]
    transports = sorted({t for r in sizes for t in r["read_transports"]["pull"]})
    raw = sorted({t for r in sizes for t in r["read_transports"]["raw"]})
    median = benchlib.median
    linger = median([r["nixl_daemon_linger_cpu"] for r in sizes])
    cma = (
        " (`cma`: the reader's kernel copies out of the other process's memory with "
        "`process_vm_readv`, no network: the transfer is a memory copy)"
        if any(t.startswith("cma") for t in [*transports, *raw])
        else ""
    )
    spins = ": it spins" if linger >= 0.5 else ""
    lines = [
        f"Placement `{placement}`: UCX's protocol tables (`UCX_PROTO_INFO=y`) name "
        f"{', '.join(transports) or 'nothing'} for the pull's RMA reads and "
        f"{', '.join(raw) or 'nothing'} for the raw ones{cma}. Share of a core: the daemon "
        f"with NIXL and its exporters, idle, {measured['nixl_daemon_idle_cpu']:.0%} (the pool "
        f"daemon, without NIXL, {median([r['pool_daemon_idle_cpu'] for r in sizes]):.0%}); the "
        f"same in the 2 s after a lease, while the exporter drives UCX's progress, "
        f"{linger:.0%}{spins}; the raw "
        f"owner, idle, {median([r['raw_owner_idle_cpu'] for r in sizes]):.0%} (NIXL's progress "
        "thread).",
    ]
    return lines + _link_lines(sizes)


def _link_lines(sizes: list[dict[str, Any]]) -> list[str]:
    """What the reader's host received beside what each side moved (none without a link)."""
    links = [(r["block_bytes"], r["reader_link"]) for r in sizes if r["reader_link"]]
    if not links:
        return []

    def mib(nbytes: int) -> str:
        return f"{nbytes / MiB:,.0f}"

    counts = "; ".join(
        f"{size_name(block)} blocks: "
        + ", ".join(f"{s} {mib(n[s]['rx_bytes'])} for {mib(n[s]['moved_bytes'])}" for s in SIDES)
        for block, n in links
    )
    verdict = (
        "every pulled byte crossed the veth pair."
        if all(link["crossed"] for _, link in links)
        else "**fewer bytes than were pulled: some took another path.**"
    )
    return [
        "The reader's host's `eth0` received, while each side ran (cold rounds included), against "
        f"the bytes the side moved: {counts} MiB: {verdict}"
    ]


def report(result: dict[str, Any]) -> None:
    benchlib.record(NAME, markdown(result, plot(result)), result)


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="block sizes (default 2M,32M)")
    parser.add_argument(
        "--total", help=f"bytes of blocks per size (default {DEFAULT_TOTAL}, {QUICK_TOTAL} quick)"
    )
    parser.add_argument(
        "--rounds", type=int, help=f"rounds after the cold one (default {DEFAULT_ROUNDS})"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"NIXL sides measured this many times a round (default {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--placements",
        default=DEFAULT_PLACEMENTS,
        help=f"where the processes run, comma-separated (default {DEFAULT_PLACEMENTS})",
    )
    parser.add_argument(
        "--pool-concurrency", type=int, default=16, help="1-key READs in flight, pool side"
    )
    parser.add_argument(
        "--keep-others-running",
        action="store_true",
        help="measure each side with the spinning processes (raw owner, daemon) running too",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_TOTAL} per size, 2 rounds")
    parser.add_argument("--no-record", action="store_true", help="leave docs/ untouched")
    parser.add_argument(
        "--report", type=Path, help="record the JSON of an earlier run (plot, section) and exit"
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.total = args.total or (QUICK_TOTAL if args.quick else DEFAULT_TOTAL)
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS
    if args.rounds < 1 or args.repeats < 1:
        parser.error("--rounds and --repeats must be at least 1")
    try:
        args.placements = [Placement(p) for p in args.placements.split(",")]
    except ValueError as exc:
        parser.error(f"{exc}: placements are local, netns")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args.child[0], args.child[1:])
    if args.report:
        report(json.loads(args.report.read_text()))
        return 0
    for placement in args.placements:
        reason = placement_unavailable(placement)
        if reason is not None:
            log(f"bench_nixl: {reason} (--placements local measures this host alone)")
            return 2
    if importlib.util.find_spec("nixl") is None:
        log("bench_nixl: NIXL is not installed (pip install 'kvtierd[nixl]'; tools/setup.sh)")
        return 2
    from kvtierd.nixl.probe import probe_nixl  # runs NIXL in a child; loads none here

    verdict = probe_nixl()
    if not verdict.ok:
        log(f"bench_nixl: NIXL failed its probe: {verdict.detail}")
        return 2
    sizes = [int(config.parse_size(s)) for s in args.sizes.split(",")]
    load_start = os.getloadavg()
    result: dict[str, Any] = {
        "benchmark": NAME,
        "nixl": verdict.detail,
        "total_bytes": int(config.parse_size(args.total)),
        "rounds": args.rounds,
        "repeats": args.repeats,
        "pool_concurrency": args.pool_concurrency,
        "others_running": args.keep_others_running,
        "placements": {},
    }
    with tempfile.TemporaryDirectory(prefix="kvtierd-nixl-bench-", dir="/tmp") as directory:
        workdir = Path(directory)
        for placement in args.placements:
            where = workdir / placement.value
            where.mkdir()
            result["placements"][placement.value] = bench_placement(placement, where, sizes, args)
    result["goals"] = goals(result)
    result["load_average"] = {"start": load_start, "end": os.getloadavg()}
    result["machine"] = benchlib.machine()
    full = not args.quick and args.sizes == DEFAULT_SIZES and args.total == DEFAULT_TOTAL
    if full and not args.no_record:
        report(result)
    benchlib.emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
