"""Bad input: thousands of random, malformed and truncated frames from several raw connections.

Afterwards the daemon is still up, answers a valid client, every block stored (and FSYNC'd)
before the attack is byte for byte what it was, no lease or pending write is left behind, and the
daemon logged no internal error (a handler that raised something other than a KvtierError).
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvtierd.client import connect
from kvtierd.protocol import MAX_KEYS_PER_REQUEST, Opcode
from kvtierd.protocol.frames import HEADER_BYTES, PROTOCOL_MINOR, REPLY_MAGIC, REQUEST_MAGIC
from kvtierd.protocol.messages import (
    AllocRequest,
    CommitRequest,
    EvictRequest,
    ForgetRequest,
    FsyncRequest,
    HintRequest,
    InitRequest,
    ListNsRequest,
    LookupRequest,
    Message,
    OpenNsRequest,
    ReadRequest,
    ReleaseRequest,
    StatfsRequest,
    encode_body,
)
from kvtierd.testing import DaemonProcess

pytestmark = pytest.mark.timeout(180)

BLOCK = 32 << 10
_HEADER = struct.Struct("<4sHHIIQII")
CONNECTIONS = 6
SESSIONS_PER_CONNECTION = 40


def frame(opcode: int, body: bytes, unique: int, ns: int = 0, **over: int) -> bytes:
    length = over.get("length", HEADER_BYTES + len(body))
    magic = over.get("magic_bytes", REQUEST_MAGIC)
    header = _HEADER.pack(magic, over.get("version", 1), opcode, length, 0, unique, ns, 0)
    return header + body


def valid_message(rng: random.Random) -> Message:
    """A well-formed request of a random kind, aimed at nothing that exists."""
    keys = [rng.randbytes(rng.randint(1, 32)) for _ in range(rng.randint(1, 8))]
    makers: list[Callable[[], Message]] = [
        lambda: LookupRequest(keys, rng.random() < 0.5),
        lambda: ReadRequest(keys),
        lambda: ReleaseRequest([rng.getrandbits(63) for _ in range(rng.randint(1, 4))]),
        lambda: AllocRequest(keys),
        lambda: CommitRequest(rng.getrandbits(63), [rng.getrandbits(63)], rng.random() < 0.5),
        lambda: ForgetRequest(keys),
        lambda: HintRequest(rng.randbytes(8), [keys]),
        lambda: OpenNsRequest(f"attacker-{rng.randrange(4)}", rng.choice([1, 4096, 1 << 40])),
        lambda: StatfsRequest(),
        lambda: ListNsRequest(),
        lambda: EvictRequest(rng.random() < 0.5),
        lambda: FsyncRequest(),
        lambda: InitRequest(rng.randrange(3), 0, rng.getrandbits(32)),
    ]
    return rng.choice(makers)()


def opcode_of(message: Message) -> int:
    from kvtierd.protocol.messages import OPCODE_OF

    return int(OPCODE_OF[type(message)])


def soft_frame(rng: random.Random, unique: int) -> bytes:
    """A frame whose header is sound: the daemon must answer it (with an errno) and go on."""
    kind = rng.randrange(7)
    ns = rng.choice([0, 1, 2, rng.getrandbits(32)])
    if kind == 0:  # random body
        return frame(rng.randint(1, 14), rng.randbytes(rng.randint(0, 300)), unique, ns)
    if kind == 1:  # a valid body with some bytes flipped
        message = valid_message(rng)
        body = bytearray(encode_body(message))
        for _ in range(rng.randint(1, 4)):
            body[rng.randrange(len(body))] = rng.getrandbits(8)
        return frame(opcode_of(message), bytes(body), unique, ns)
    if kind == 2:  # unknown opcode
        return frame(rng.choice([0, 15, 99, 0xFFFF]), rng.randbytes(rng.randint(0, 40)), unique)
    if kind == 3:  # over the per-request key limit
        keys = [b"x" * 16] * (MAX_KEYS_PER_REQUEST + 1)
        return frame(Opcode.LOOKUP, encode_body(LookupRequest(keys)), unique, ns)
    if kind == 4:  # a body for another opcode
        message = valid_message(rng)
        return frame(rng.randint(1, 14), encode_body(message), unique, ns)
    message = valid_message(rng)  # well formed, bogus ids and namespaces
    return frame(opcode_of(message), encode_body(message), unique, ns)


def fatal_tail(rng: random.Random, unique: int) -> bytes:
    """Bytes after which the stream cannot be trusted: the daemon closes the connection."""
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.randint(8, 400))
    if kind == 1:
        return frame(Opcode.STATFS, b"\x90", unique, magic_bytes=b"EVIL")
    if kind == 2:
        return frame(Opcode.STATFS, b"\x90", unique, version=rng.choice([0, 2, 0xFFFF]))
    if kind == 3:
        return frame(Opcode.STATFS, b"", unique, length=rng.choice([0, 31, 0xFFFFFFFF, 64 << 20]))
    if kind == 4:
        return frame(Opcode.STATFS, b"\x90", 0)  # unique id 0
    return frame(Opcode.STATFS, b"", unique, length=(1 << 20) + 1)  # over the frame limit


class Attacker:
    def __init__(self, path: Path, seed: int) -> None:
        self.path = path
        self.rng = random.Random(seed)
        self.sent = 0
        self.errors: list[str] = []

    def run(self) -> None:
        try:
            for _ in range(SESSIONS_PER_CONNECTION):
                self.session()
        except Exception as exc:  # reported by the test, not lost in a thread
            self.errors.append(repr(exc))

    def session(self) -> None:
        # the daemon may close first (a frame that decoded as DESTROY, a fatal tail)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._session()

    def _session(self) -> None:
        rng = self.rng
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20)
            sock.connect(str(self.path))
            unique = 1
            frames = []
            if rng.random() < 0.7:
                init = InitRequest(1, PROTOCOL_MINOR, 1 << 20, "attacker")
                frames.append(frame(Opcode.INIT, encode_body(init), unique))
                unique += 1
            for _ in range(rng.randint(5, 40)):
                frames.append(soft_frame(rng, unique))
                unique += 1
            sentinel = unique
            frames.append(frame(Opcode.LIST_NS, encode_body(ListNsRequest()), sentinel))
            sock.sendall(b"".join(frames))
            self.sent += len(frames)
            if not self.read_until(sock, sentinel):
                return
            ending = rng.randrange(3)
            if ending == 0:  # cut a valid frame short and leave
                whole = soft_frame(rng, unique + 1)
                sock.sendall(whole[: rng.randrange(1, len(whole))])
            elif ending == 1:
                sock.sendall(fatal_tail(rng, unique + 1))
                self.read_until(sock, None)  # the daemon closes the connection
            self.sent += 1

    def read_until(self, sock: socket.socket, unique: int | None) -> bool:
        """Read replies (checking their framing) until ``unique`` is answered or EOF; returns
        whether the connection is still open."""
        buffer = b""
        while True:
            while len(buffer) >= HEADER_BYTES:
                magic, _, _, length, _, reply_unique, _, _ = _HEADER.unpack_from(buffer)
                assert magic == REPLY_MAGIC, buffer[:8]
                assert HEADER_BYTES <= length <= 1 << 20
                if len(buffer) < length:
                    break
                buffer = buffer[length:]
                if reply_unique == 0:  # the daemon's last word; it closes the connection
                    self.read_to_eof(sock)
                    return False
                if unique is not None and reply_unique == unique:
                    return True
            data = sock.recv(1 << 16)
            if not data:
                return False
            buffer += data

    @staticmethod
    def read_to_eof(sock: socket.socket) -> None:
        while sock.recv(1 << 16):
            pass


def _blocks(n: int) -> list[bytes]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]


def test_random_and_truncated_frames_change_nothing(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "kvtierd") as daemon:
        blocks = _blocks(24)
        with connect(daemon.socket) as client:
            ns = client.namespace("victim", block_bytes=BLOCK)
            keys = [bytes([i]) * 16 for i in range(24)]
            assert ns.put(keys, blocks) == 24
            client.fsync()
            client.evict()  # half the reads after the attack come from the NVMe tier
            assert ns.put([b"dram-only" + bytes(7)], [blocks[0]]) == 1

        attackers = [Attacker(daemon.socket, seed) for seed in range(CONNECTIONS)]
        threads = [threading.Thread(target=a.run) for a in attackers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(150)
        assert not any(thread.is_alive() for thread in threads), "an attacker hung"
        assert [a.errors for a in attackers] == [[]] * CONNECTIONS
        assert sum(a.sent for a in attackers) >= 2000
        assert daemon.running

        with connect(daemon.socket, timeout_s=30) as client:
            ns = client.namespace("victim", block_bytes=BLOCK)
            assert ns.lookup(keys) == 24
            with ns.get(keys) as views:
                assert [bytes(v) for v in views] == blocks
            with ns.get([b"dram-only" + bytes(7)]) as views:
                assert bytes(views[0]) == blocks[0]
            deadline = time.monotonic() + 30
            while (stats := client.stats())["connections"] > 1 and time.monotonic() < deadline:
                time.sleep(0.05)  # attacker sessions finish closing
            assert stats["connections"] == 1
            assert stats["leases"] == 0
            assert stats["leased_blocks"] == 0
            assert stats["pending_writes"] == 0
        log = daemon.log()
        assert "Traceback" not in log, log[-3000:]
        assert "handler for" not in log, log[-3000:]  # no internal error
