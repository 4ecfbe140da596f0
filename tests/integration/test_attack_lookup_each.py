"""Attacks on LOOKUP with ``each`` (protocol minor 10: ``LookupRequest.each``,
``BlockStore.lookup_each``, ``BlockIndex.each``, the inline ``lookup_now`` path) from a hostile
client, on the real daemon.

What a client controls is the keys (1..8192, any bytes, duplicates), ``promote``, ``each``, the
namespace it sends on (its ``world_size``: up to ``limits.max_world_size``, 256 by default, with
every rank's namespace opened by itself, none holding a block) and how many frames it pipelines.
The rules: nothing of that crashes the daemon or changes a block; a bad body is ``EINVAL``; a
namespace not opened on the connection is refused; ``promote=False`` moves nothing; promotion
stays within the tenant's region; and no request holds the event loop much longer than plain
LOOKUP of the same keys does.

Found here: ``lookup_each`` on a TP namespace asks every rank of the group about every key
(``_usable_each(member, keys)``, NVMe rows included) whatever the ranks before it answered, where
plain LOOKUP asks each rank only about the leading hits left: a client that opens the 256 ranks
of a group (empty, nothing stored but rank 0's blocks) makes one LOOKUP of 8192 keys with
``each`` hold the loop for ~170 ms (plain LOOKUP of the same keys: ~4 ms), and the inline path
(``lookup_now``, run from the socket's readiness callback for every frame of a read) answers
256-key ones there at ~7 ms each: 40 pipelined such frames stalled another connection's LOOKUP
~280 ms. Both lane decisions (inline or not, ``lookup_in_turn``) look at ``len(keys)`` only,
not at ``len(keys) * world_size``. The timing tests compare with the same requests on a
``world_size`` 1 namespace on the same daemon (a coarse ratio, never a wall-clock bound).
"""

from __future__ import annotations

import itertools
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvtierd.client import Namespace, connect
from kvtierd.errors import AccessDeniedError, InvalidRequestError
from kvtierd.protocol import MAX_KEYS_PER_REQUEST, ClientConnection, Opcode
from kvtierd.protocol.frames import HEADER_BYTES, PROTOCOL_MINOR, RequestHeader
from kvtierd.protocol.messages import (
    InitRequest,
    LookupReply,
    LookupRequest,
    OpenNsReply,
    OpenNsRequest,
)
from kvtierd.testing import DaemonProcess
from tests.support.attacks import tier_usage, unharmed
from tests.support.rawpeer import DEADLINE_S, RawPeer
from tests.support.uids import call_as, reachable_directory, require_root

pytestmark = pytest.mark.timeout(300)

MISS = 3  # LOOKUP's code, with ``each``, of a key not stored (docs/protocol.md)
WIDE = 256  # limits.max_world_size's default: the widest TP group a client may declare
SMALL = 4 << 10
_UNIQUES = itertools.count(1 << 40)


def _zeros(n: int, nbytes: int = SMALL) -> list[np.ndarray]:
    return [np.zeros(nbytes, np.uint8)] * n


def _raw(peer: RawPeer, body: bytes, ns: int | None = None) -> tuple[LookupReply | None, object]:
    """Send LOOKUP ``body`` by hand on ``peer``: (the reply, or None; the error, or None)."""
    unique = next(_UNIQUES)  # far above the ids the peer's own requests take
    header = RequestHeader(
        Opcode.LOOKUP, HEADER_BYTES + len(body), unique, peer.ns if ns is None else ns
    )
    peer.conn._pending[unique] = Opcode.LOOKUP  # sent by hand: the reply must match it
    peer.sock.sendall(header.pack() + body)
    event = peer.next_reply()
    assert event.header.unique == unique
    return event.message, event.error  # type: ignore[return-value]


def _median_s(call: Callable[[], object], times: int = 5) -> float:
    spent = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvtierd", dram_size="128M", nvme_size="256M") as process:
        yield process


def _wide_group(client: object, name: str, keys: list[bytes]) -> list[Namespace]:
    """Every rank of a ``WIDE`` TP group opened, rank 0 holding ``keys``, the others nothing."""
    ranks = [
        client.namespace(name, block_bytes=SMALL, rank=r, world_size=WIDE)  # type: ignore[attr-defined]
        for r in range(WIDE)
    ]
    assert ranks[0].put(keys, _zeros(len(keys))) == len(keys)
    return ranks


# -- the event loop ----------------------------------------------------------------------------


def test_each_on_a_wide_group_costs_about_what_it_costs_on_one_rank(
    daemon: DaemonProcess,
) -> None:
    """8192 keys, all in rank 0's DRAM, the 255 other ranks opened and empty: every key is a
    miss for the group, which the first empty rank settles; ``each`` must not then ask the 254
    others about all 8192 keys again, on the loop, in one step (plain LOOKUP does not)."""
    keys = [b"wide-%06d" % i for i in range(MAX_KEYS_PER_REQUEST)]
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        solo = client.namespace("solo", block_bytes=SMALL)
        assert solo.put(keys, _zeros(len(keys))) == len(keys)
        rank0 = _wide_group(client, "wide", keys)[0]
        assert solo.lookup_each(keys, promote=False) == ["dram"] * len(keys)
        assert rank0.lookup_each(keys, promote=False) == [None] * len(keys)  # the group lacks them
        assert rank0.lookup(keys, promote=False) == 0
        one_rank = _median_s(lambda: solo.lookup_each(keys, promote=False))
        plain_wide = _median_s(lambda: rank0.lookup(keys, promote=False))
        each_wide = _median_s(lambda: rank0.lookup_each(keys, promote=False))
    unharmed(daemon)
    ratio = f"each on 256 ranks {each_wide * 1e3:.1f} ms, on one {one_rank * 1e3:.1f} ms, plain "
    ratio += f"LOOKUP on 256 ranks {plain_wide * 1e3:.1f} ms"
    assert each_wide < 6 * max(one_rank, plain_wide) + 0.02, ratio


def _watch_while(daemon: DaemonProcess, attack: Callable[[], None]) -> float:
    """The longest another connection's one-key LOOKUP waited while ``attack`` ran."""
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        watched = client.namespace("watched", block_bytes=SMALL)
        watched.put([b"watched"], _zeros(1))
        stop = threading.Event()
        waits: list[float] = []

        def watch() -> None:
            while not stop.is_set():
                start = time.perf_counter()
                assert watched.lookup([b"watched"]) == 1
                waits.append(time.perf_counter() - start)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            time.sleep(0.2)
            attack()
            time.sleep(0.1)
        finally:
            stop.set()
            watcher.join(DEADLINE_S)
    assert waits
    return max(waits)


def _peer(path: Path, request: OpenNsRequest) -> RawPeer:
    """A :class:`RawPeer` whose namespace is the one ``request`` opens (rank, world size,
    tenant as it says)."""
    peer = RawPeer.__new__(RawPeer)
    peer.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.sock.settimeout(DEADLINE_S)
    peer.sock.connect(str(path))
    peer.conn = ClientConnection()
    peer.ns = 0
    peer.call(InitRequest(1, PROTOCOL_MINOR, 1 << 20, "attacker"))
    reply = peer.call(request)
    assert isinstance(reply, OpenNsReply)
    peer.ns = reply.ns
    return peer


def _pipelined_each(daemon: DaemonProcess, name: str, world_size: int, keys: list[bytes]) -> None:
    """3 times 40 LOOKUPs with ``each`` of ``keys`` (inline-sized) on rank 0 of ``name``, each
    40 sent in one write; each answered right."""
    peer = _peer(daemon.socket, OpenNsRequest(name, SMALL, None, 0, world_size))
    frames = 40
    for _ in range(3):
        batch = b"".join(peer.frame(LookupRequest(keys, False, True)) for _ in range(frames))
        peer.sock.sendall(batch)
        for _ in range(frames):
            event = peer.next_reply()
            assert event.error is None, event.error
            assert isinstance(event.message, LookupReply)
            assert len(event.message.tiers) == len(keys)
    peer.sock.close()


def test_inline_each_lookups_on_a_wide_group_do_not_stall_other_connections(
    daemon: DaemonProcess,
) -> None:
    """256 keys (the lane's ``inline_items``: answered from the readiness callback) times 256
    ranks is 65536 probes a frame, answered inline frame after frame: another connection's
    LOOKUP must not wait much longer than it does for the same frames on one rank."""
    keys = [b"inline-%04d" % i for i in range(256)]
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        solo = client.namespace("solo", block_bytes=SMALL)
        assert solo.put(keys, _zeros(len(keys))) == len(keys)
        _wide_group(client, "wide", keys)
    one_rank = _watch_while(daemon, lambda: _pipelined_each(daemon, "solo", 1, keys))
    wide = _watch_while(daemon, lambda: _pipelined_each(daemon, "wide", WIDE, keys))
    unharmed(daemon)
    assert wide < 4 * one_rank + 0.05, (
        f"a LOOKUP waited {wide * 1e3:.0f} ms behind inline LOOKUPs with each on 256 ranks, "
        f"{one_rank * 1e3:.0f} ms behind the same on one rank"
    )


# -- bad bodies, other namespaces ----------------------------------------------------------------


def test_bad_lookup_bodies_around_each_are_einval_and_the_connection_goes_on(
    daemon: DaemonProcess,
) -> None:
    keys = [b"body-%02d" % i for i in range(8)]
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        ns = client.namespace("bodies", block_bytes=SMALL)
        assert ns.put(keys[:4], _zeros(4)) == 4
    peer = RawPeer(daemon.socket, "bodies", SMALL)
    enc = msgspec.msgpack.encode
    bad = {
        "four elements": enc([keys, True, True, True]),
        "four elements, each false": enc([keys, True, False, False]),
        "each 1": enc([keys, True, 1]),
        "each 0": enc([keys, True, 0]),
        "each nil": enc([keys, True, None]),
        "each a string": enc([keys, True, "yes"]),
        "each bytes": enc([keys, True, b"\x01"]),
        "each a map": enc([keys, True, {}]),
        "each an array": enc([keys, True, [True]]),
        "no keys": enc([[], True, True]),
        "an empty key": enc([[b""], True, True]),
        "a key of 33 bytes": enc([[b"k" * 33], True, True]),
        "a key not bytes": enc([["k"], True, True]),
        "8193 keys": enc([[keys[0]] * (MAX_KEYS_PER_REQUEST + 1), True, True]),
        "a map body": enc({"keys": keys, "promote": True, "each": True}),
    }
    for what, body in bad.items():
        reply, error = _raw(peer, body)
        assert reply is None, (what, reply)
        assert isinstance(error, InvalidRequestError), (what, error)
        assert "internal" not in str(error), (what, error)
    # the same connection still answers; 8192 duplicates of one key with each and promote
    reply, error = _raw(peer, enc([keys, True, True]))
    assert error is None
    assert reply == LookupReply(4, bytes([0, 0, 0, 0, MISS, MISS, MISS, MISS]))
    reply, error = _raw(peer, enc([[keys[5], keys[0]] * (MAX_KEYS_PER_REQUEST // 2), True, True]))
    assert error is None
    assert reply is not None
    assert reply.hits == 0
    assert reply.tiers == bytes([MISS, 0]) * (MAX_KEYS_PER_REQUEST // 2)
    # the two-field body an older client sends is plain LOOKUP
    reply, error = _raw(peer, enc([keys, True]))
    assert error is None
    assert reply == LookupReply(4, bytes(4))
    # a namespace never opened on this connection: refused whatever ``each`` says
    for ns_id in (0, peer.ns + 1, 2**32 - 1):
        reply, error = _raw(peer, enc([keys, False, True]), ns=ns_id)
        assert isinstance(error, InvalidRequestError), (ns_id, reply, error)
    peer.sock.close()
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        ns = client.namespace("bodies", block_bytes=SMALL)
        with ns.get(keys[:4]) as views:
            assert all(bytes(v) == bytes(SMALL) for v in views)
    unharmed(daemon)


def test_each_on_a_tp_group_answers_for_the_whole_group_and_misses_a_rank_never_opened(
    daemon: DaemonProcess,
) -> None:
    keys = [b"tp-%02d" % i for i in range(12)]
    with connect(daemon.socket, timeout_s=DEADLINE_S) as client:
        r0 = client.namespace("tp4", block_bytes=SMALL, rank=0, world_size=4)
        r1 = client.namespace("tp4", block_bytes=SMALL, rank=1, world_size=4)
        r2 = client.namespace("tp4", block_bytes=SMALL, rank=2, world_size=4)
        r0.put(keys, _zeros(len(keys)))
        r1.put(keys[::2], _zeros(len(keys[::2])))
        r2.put(keys[:8], _zeros(8))
        # rank 3 never opened: the group has nothing, on every path
        assert r0.lookup_each(keys) == [None] * len(keys)
        assert r0.lookup_each(keys[:3]) == [None] * 3  # the inline path
        assert r0.lookup(keys) == 0
        r3 = client.namespace("tp4", block_bytes=SMALL, rank=3, world_size=4)
        r3.put(keys[1:], _zeros(len(keys) - 1))
        expected = ["dram" if i % 2 == 0 and 0 < i < 8 else None for i in range(len(keys))]
        for rank in (r0, r1, r2, r3):
            assert rank.lookup_each(keys, promote=False) == [
                None if e is None else "dram" for e in expected
            ]
        assert r0.lookup(keys) == 0  # key 0 is not on rank 3: no leading hit
    unharmed(daemon)


def _each_on_anothers_namespace(socket_path: str, ns_id: int, name: str, tenant: str) -> list[str]:
    """As another tenant's uid: LOOKUP with ``each`` on ``ns_id`` (not opened here) by hand,
    on a connection with a namespace of its own tenant open, and OPEN_NS of ``name`` in
    ``tenant``; the class of what each said."""
    said = []
    peer = _peer(Path(socket_path), OpenNsRequest("mine", SMALL, tenant="beta"))
    for target in (ns_id, peer.ns):
        peer.sock.sendall(peer.conn.request(LookupRequest([b"secret-00"], True, True), target)[1])
        event = peer.next_reply()
        said.append(type(event.error or event.message).__name__)
    peer.sock.close()
    with connect(socket_path, timeout_s=DEADLINE_S) as client:
        try:
            client.namespace(name, block_bytes=SMALL, tenant=tenant, create=False)
            said.append("opened")
        except Exception as exc:  # what it was is the answer
            said.append(type(exc).__name__)
    return said


TENANTS = """
[daemon]
socket_mode = "0666"

[dram]
size = "48M"
# no reuse guesses: what moves, a LOOKUP moved (the guesses stay in free room of the region)
prefetch_bytes_per_s = 0

[[tenants]]
name = "alpha"
uids = [2001]
dram_size = "8M"

[[tenants]]
name = "beta"
uids = [2002]
dram_size = "8M"
"""


@pytest.fixture
def tenants() -> Iterator[DaemonProcess]:
    require_root()
    with reachable_directory() as directory:
        process = DaemonProcess(directory, dram_size=None, config_text=TENANTS).start()
        try:
            yield process
        finally:
            process.kill()


def test_each_on_another_tenants_namespace_is_refused(tenants: DaemonProcess) -> None:
    with connect(tenants.socket, timeout_s=DEADLINE_S) as client:
        secret = client.namespace("secret", block_bytes=SMALL, tenant="alpha")
        secret.put([b"secret-00"], _zeros(1))
        said = call_as(
            2002,
            2002,
            _each_on_anothers_namespace,
            str(tenants.socket),
            secret.handle.ns,
            "secret",
            "alpha",
        )
    # refused on alpha's namespace; on its own (the same key, never stored there) a miss
    assert said == [
        InvalidRequestError.__name__,
        LookupReply.__name__,
        AccessDeniedError.__name__,
    ]
    unharmed(tenants)


# -- promotion ---------------------------------------------------------------------------------

BIG = 256 << 10  # 32 blocks fill an 8 MiB region


def _settle(client: object, ns: Namespace, keys: list[bytes]) -> list[str | None]:
    """The tiers of ``keys`` once nothing has moved for a while (promotions run behind)."""
    last: list[str | None] = []
    for _ in range(100):
        now = ns.lookup_each(keys, promote=False)
        if now == last:
            return now
        last = now
        time.sleep(0.05)
    return last


def test_each_without_promote_moves_nothing_and_with_it_stays_in_the_tenants_region(
    tenants: DaemonProcess,
) -> None:
    """alpha: 96 blocks of 256 KiB on NVMe (three times its 8 MiB region), named with misses
    between them; beta: 24 blocks in its own region's DRAM. LOOKUP with ``each`` and without
    ``promote`` (inline-sized and lane-sized, again and again) moves nothing; with it, alpha's
    DRAM never passes its region and every one of beta's blocks stays in DRAM, its bytes as
    put."""
    cold = [b"cold-%04d" % i for i in range(96)]
    absent = [b"absent-%04d" % i for i in range(96)]
    chain = [k for pair in zip(absent, cold, strict=True) for k in pair]  # a miss before each
    beta_keys = [b"beta-%02d" % i for i in range(24)]
    beta_blocks = [np.full(BIG, i + 1, np.uint8) for i in range(24)]
    with connect(tenants.socket, timeout_s=DEADLINE_S) as client:
        alpha = client.namespace("alpha-ns", block_bytes=BIG, tenant="alpha")
        for i in range(0, len(cold), 16):
            assert alpha.put(cold[i : i + 16], _zeros(16, BIG)) == 16
            client.fsync()
        beta = client.namespace("beta-ns", block_bytes=BIG, tenant="beta")
        assert beta.put(beta_keys, beta_blocks) == len(beta_keys)
        client.fsync()
        client.evict()  # alpha's leave DRAM; beta's are clean too: read them back in
        with beta.get(beta_keys):
            pass
        assert set(alpha.lookup_each(cold, promote=False)) == {"nvme"}
        dram_before = tier_usage(client, "dram")
        for _ in range(20):
            for keys in (chain[:200], chain[:40], chain[1:3], [cold[5]] * 300):
                tiers = alpha.lookup_each(keys, promote=False)
                assert all(t in ("nvme", None) for t in tiers), tiers
        assert _settle(client, alpha, cold) == ["nvme"] * len(cold)
        assert tier_usage(client, "dram") == dram_before
        # now promote: everything alpha names, again and again
        for _ in range(10):
            alpha.lookup_each(chain)
            alpha.lookup_each(chain[::-1][:64])
        tiers = _settle(client, alpha, cold)
        in_dram = tiers.count("dram")
        assert 0 < in_dram <= (8 << 20) // BIG, tiers
        assert beta.lookup_each(beta_keys, promote=False) == ["dram"] * len(beta_keys)
        with beta.get(beta_keys) as views:
            assert [bytes(v) for v in views] == [b.tobytes() for b in beta_blocks]
        for i in range(0, len(cold), 8):  # every cold block, read back whole
            with alpha.get(cold[i : i + 8]) as views:
                assert all(bytes(v) == bytes(BIG) for v in views)
    unharmed(tenants)
