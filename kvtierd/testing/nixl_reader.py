"""A client of a real daemon that pulls over NIXL, run as ``python -m kvtierd.testing.nixl_reader``.

``SOCKET TENANT NS BLOCK_BYTES COUNT CASE [UID]``: connects to the daemon at ``SOCKET`` (as
``UID`` when given: NIXL and the client are loaded first, then the process drops to that uid
and gid; ``SOCKET`` may be ``tcp://HOST:PORT``, or ``tls://HOST:PORT`` with the CA and this
client's certificate and key in ``$KVTIERD_TEST_TLS``, ``ca.pem`` and ``client.pem``),
opens namespace ``NS`` of ``TENANT`` with blocks of ``BLOCK_BYTES``, and names the
blocks the test stored there (:func:`block_keys`, :func:`block_content`). Each
case prints JSON lines, the last one ``{"error": ..., ...}`` (``error`` is ``Class: message``
or ""), and the process ends through :func:`kvtierd.nixl.agent.exit_process`:

* ``pull``: :meth:`~kvtierd.client.nixl.NixlReader.read_into` every block; ``sha256`` of each.
* ``grant``: the region and agent NIXL_GRANT names for this namespace (``region``,
  ``handle_region``, ``agent``).
* ``released``: lease the blocks, print ``{"leased": true}``, release the lease, wait for a
  line on stdin (the test overwrites the slots meanwhile), pull the stale descriptors with the
  agent directly, as a transfer still in flight when the lease ended would, and report whether
  those bytes are still the blocks' (``stale_sha256``) and what
  :meth:`~kvtierd.client.nixl.NixlReader.verify` raised.
* ``held``: lease, print ``{"leased": true}``, wait for a line (the test evicts and overwrites
  meanwhile), then pull: ``sha256`` of each.
* ``scribble``: lease, overwrite the first block's slot through this client's own mapping of
  its region (what any client of the tenant can do), then pull.
* ``loop``: pull every block again and again, printing ``{"pulled": n}`` after each (the test
  kills it mid-transfer).
* ``write``: store the blocks (``put``), which a TCP connection cannot.
* ``read``: read them through the shared-memory path (``get``), which a TCP connection cannot.
* ``widen``: the attack of issue 31. Lease the blocks (to learn where the region is in the
  exporting process: a descriptor's address less its extent's region offset), widen the
  registration inside the region's NIXL_GRANT metadata (:func:`widened`) and load it as another
  agent's, then pull each probe of ``$KVTIERD_TEST_PROBES`` (a JSON list of ``[name, offset,
  length]``, ``offset`` from the region's base, negative below it; ``name`` ``unmapped`` reads
  ``length`` bytes at address 4096 instead) with forged descriptors, in order, each into
  ``$KVTIERD_TEST_OUT/NAME.bin``; ``probes`` maps each name to "" (bytes arrived) or the error.
* ``overwrite``: the WRITE attack of issue 31's second review, with the honest grant. Lease the
  blocks (which keeps the exporter driving UCX), print ``{"leased": true}``, wait for a line
  (the test has a slot allocated and filled, not committed, meanwhile), then NIXL WRITE
  ``0xEE`` over the first ``$KVTIERD_TEST_WRITE_BYTES`` of the region (the honest
  registration covers all of it: the committed blocks and the slot being filled);
  ``write`` is NIXL's final state (``DONE``, ``ERR``) or the error raised.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time
import traceback
from typing import Any

import msgspec
import numpy as np

from kvtierd.nixl import descriptors

#: The daemon tests' two tenants, ``alpha`` (uid 2001) and ``beta`` (uid 2002), 16 MiB each.
TWO_TENANTS = """
[[tenants]]
name = "alpha"
uids = [2001]
dram_size = "16M"

[[tenants]]
name = "beta"
uids = [2002]
dram_size = "16M"
"""


def block_keys(name: str, count: int) -> list[bytes]:
    """The keys of the ``count`` blocks a test stores in namespace ``name``."""
    return [hashlib.sha256(f"{name}/{i}".encode()).digest()[:16] for i in range(count)]


def block_content(name: str, i: int, block_bytes: int) -> np.ndarray:
    """Block ``i`` of namespace ``name``: random bytes, different in every block."""
    seed = int.from_bytes(hashlib.sha256(f"{name}/{i}".encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, block_bytes, dtype=np.uint8)


def main(argv: list[str]) -> dict[str, Any]:
    socket, tenant, name, block_text, count_text, case, *uid = argv
    block_bytes, count = int(block_text), int(count_text)

    import nixl._api  # noqa: F401  (loaded while every file is readable)

    from kvtierd.client.nixl import NixlReader
    from kvtierd.nixl.agent import NixlAgent

    agent = NixlAgent(f"reader-{os.getpid()}", progress_thread=False)  # pulls only
    if uid:
        os.setgroups([])
        os.setgid(int(uid[0]))
        os.setuid(int(uid[0]))
    keys = block_keys(name, count)
    result: dict[str, Any] = {"error": ""}
    try:
        client = _connect(socket)
    except Exception as exc:  # refused: what the caller sees is the test's point
        agent.close()
        return {"error": f"{type(exc).__name__}: {exc}"}
    with client:
        reader = NixlReader(client, agent)
        memory = reader.register(np.zeros(count * block_bytes, np.uint8))
        buffers = [memory[i * block_bytes : (i + 1) * block_bytes] for i in range(count)]

        def digests() -> list[str]:
            return [hashlib.sha256(b).hexdigest() for b in buffers]

        try:
            ns = client.namespace(name, block_bytes=block_bytes, tenant=tenant)
            if case == "pull":
                reader.read_into(ns, keys, buffers)
                result["sha256"] = digests()
            elif case == "grant":
                from kvtierd.client import ops

                grant = ns._run(lambda: ops.nixl_grant(ns.handle.ns))
                result.update(region=grant.region, handle_region=ns.handle.region,
                              agent=grant.agent)  # fmt: skip
            elif case == "released":
                lease = reader.lease(ns, keys)
                _say({"leased": True})
                lease.release()
                sys.stdin.readline()
                start = 0
                for reply in lease.replies:
                    parts = buffers[start : start + len(reply.extents)]
                    pairs = zip(parts, reply.extents, strict=True)
                    local = [(_address(p), e.length) for p, e in pairs]
                    agent.pull(lease.peer, reply.descriptors, local, timeout_s=30)
                    start += len(reply.extents)
                result["stale_sha256"] = digests()
                reader.verify(lease, buffers)
            elif case == "held":
                with reader.lease(ns, keys) as lease:
                    _say({"leased": True})
                    sys.stdin.readline()
                    reader.pull(lease, buffers)
                result["sha256"] = digests()
            elif case == "scribble":
                with reader.lease(ns, keys) as lease:
                    extent = lease.replies[0].extents[0]
                    ns.arena.writable(extent.offset, 64)[:] = b"\xff" * 64
                    reader.pull(lease, buffers)
            elif case == "loop":
                n = 0
                while True:
                    reader.read_into(ns, keys, buffers)
                    n += 1
                    _say({"pulled": n})
            elif case == "widen":
                result["probes"] = _widen(ns, reader, keys)
            elif case == "overwrite":
                result["write"] = _overwrite(ns, reader, keys)
            elif case == "write":
                ns.put(keys, [np.zeros(block_bytes, np.uint8) for _ in keys])
            elif case == "read":
                with ns.get(keys) as views:
                    result["sha256"] = [hashlib.sha256(v).hexdigest() for v in views]
            else:
                raise SystemExit(f"unknown case {case!r}")
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["traceback"] = traceback.format_exc()
        reader.close()
    agent.close()
    return result


def widened(metadata: bytes, base: int, length: int) -> bytes:
    """``metadata`` (NIXL's serialisation of one registration) with that registration's address
    and length replaced by ``base`` and ``length``: what the attacker of issue 31 did. The
    list is ``|n`` (8-byte size, 8-byte count), then each element as ``|`` (8-byte size) and
    its address and length first, little-endian."""
    count = metadata.index(b"|n", metadata.index(b"nixlSDList"))
    entry = count + 2 + 8 + 8 + 1 + 8
    return metadata[:entry] + struct.pack("<QQ", base, length) + metadata[entry + 16 :]


def _widen(ns: Any, reader: Any, keys: list[bytes]) -> dict[str, str]:
    """The ``widen`` case (module docstring): each probe against the exporter serving then
    (an earlier probe may have killed the one before)."""
    agent = reader.agent
    out = os.environ["KVTIERD_TEST_OUT"]
    outcome: dict[str, str] = {}
    peer = ""
    for name, offset, length in json.loads(os.environ["KVTIERD_TEST_PROBES"]):
        buffer = reader.register(np.zeros(length, np.uint8))
        try:
            base, metadata = _locate(ns, reader, keys)
            address = 4096 if name == "unmapped" else base + offset
            if peer:
                agent.remove_peer(peer)
                peer = ""
            # A registration widened to the probe: what the attacker's NIXL then checks forged
            # descriptors against (the exporting side checks nothing).
            peer = agent.add_peer(widened(metadata, address, length))
            remote = descriptors.encode(peer, [(address, length)], [(address, length)])
            agent.pull(peer, remote, [(_address(buffer), length)], timeout_s=15)
            outcome[name] = ""
        except Exception as exc:
            outcome[name] = f"{type(exc).__name__}: {exc}"
        with open(os.path.join(out, f"{name}.bin"), "wb") as f:
            f.write(buffer)
        print(f"probe {name}: {outcome[name] or 'bytes arrived'}", flush=True)
    return outcome


def _overwrite(ns: Any, reader: Any, keys: list[bytes]) -> str:
    """The ``overwrite`` case (module docstring): NIXL's final state of the WRITE, or the
    error it raised."""
    from kvtierd.nixl.agent import _DRAM

    length = int(os.environ["KVTIERD_TEST_WRITE_BYTES"])
    poison = reader.register(np.full(length, 0xEE, np.uint8))
    with reader.lease(ns, keys) as lease:
        reply = lease.replies[0]
        own = msgspec.msgpack.decode(reply.descriptors, type=descriptors.Descriptors)
        base = own.extents[0][0] - reply.extents[0].offset
        _say({"leased": True})
        sys.stdin.readline()
        agent = reader.agent._agent  # NIXL's own: the attacker is not bound to kvtierd's API
        try:
            remote = agent.get_xfer_descs([(base, length, 0)], _DRAM)
            local = agent.get_xfer_descs([(_address(poison), length, 0)], _DRAM)
            handle = agent.initialize_xfer("WRITE", local, remote, lease.peer)
            state = agent.transfer(handle)
            deadline = time.monotonic() + 20
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                time.sleep(0.005)
                state = agent.check_xfer_state(handle)
            return str(state)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"


def _locate(ns: Any, reader: Any, keys: list[bytes]) -> tuple[int, bytes]:
    """Where the region is in the exporting process (a descriptor's address less its extent's
    region offset) and the region's grant metadata, from an honest lease and grant; tried again
    while the exporter restarts (``StartingError``)."""
    from kvtierd.client import ops
    from kvtierd.errors import StartingError

    for attempt in range(60):
        try:
            with reader.lease(ns, keys) as lease:
                reply = lease.replies[0]
                own = msgspec.msgpack.decode(reply.descriptors, type=descriptors.Descriptors)
                grant = ns._run(lambda: ops.nixl_grant(ns.handle.ns))
            if grant.agent == own.agent:
                return own.extents[0][0] - reply.extents[0].offset, grant.metadata
        except StartingError:
            if attempt == 59:
                raise
        time.sleep(1)
    raise RuntimeError("the exporter kept changing")


def _connect(where: str) -> Any:
    """A client of the daemon at ``where``: a socket path, ``tcp://`` or ``tls://``."""
    from kvtierd.client import connect
    from kvtierd.client.endpoint import client_tls_context
    from kvtierd.client.sync import connect_tcp

    scheme, _, address = where.partition("://")
    if not address:
        return connect(where)
    host, _, port = address.rpartition(":")
    tls = None
    if scheme == "tls":
        directory = os.environ["KVTIERD_TEST_TLS"]
        pem = os.path.join(directory, "client.pem")
        tls = client_tls_context(os.path.join(directory, "ca.pem"), pem, pem)
    return connect_tcp(host, int(port), tls=tls, timeout_s=60)


def _address(view: memoryview) -> int:
    from kvtierd.io.buffers import buffer_address

    return buffer_address(view)


def _say(line: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    from kvtierd.nixl.agent import exit_process

    try:
        _say(main(sys.argv[1:]))
    except BaseException:
        traceback.print_exc()
        exit_process(1)
    exit_process(0)
