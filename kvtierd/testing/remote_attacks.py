"""The crash soak's remote and NIXL attackers (hostile runs of :mod:`kvtierd.testing.crash`;
issue 31).

With them the soak's daemon also listens on TCP (``remote.listen`` on loopback, TLS with client
certificates, ``nixl.enabled``), and two more attackers join the hostile tenant's:

* :class:`RemoteAttacker`, a thread of every cycle's write phase, attacks the TCP listener the
  ways a port scanner, a load balancer's health check or a hostile host does: it connects and
  closes before the handshake, sends part of a TLS ClientHello and closes, sends junk, resets
  the connection (``SO_LINGER`` 0), shakes hands with a certificate of another CA, holds a
  flood of idle connections for a moment, and, through a certificate listed for the hostile
  tenant, asks for what a TCP client may not have: to create a namespace and to write. A
  refused attack is an outcome; one that succeeds (a session without a valid certificate, a
  namespace created or a block written over TCP) is a defence failure. Meanwhile the honest
  clients on the Unix socket must be served as always: their failure while the daemon is up is
  a violation, and so is the daemon's exit.
* :func:`nixl_attack`, run once a cycle after the restart's verification, is a child
  (:mod:`kvtierd.testing.nixl_reader`, case ``widen``) of the hostile tenant that leases its own
  blocks, widens the registration in its NIXL_GRANT metadata and READs around its region: the next
  32 MiB, 64 MiB below it, and an unmapped address. Even cycles it connects over TCP with TLS and
  ``UCX_TLS=tcp``; odd cycles through the Unix socket, UCX choosing (``cma`` on one host). Any
  honest block found in what arrived is a defence failure; the daemon must still serve its Unix
  socket and its TCP listener afterwards, and the cycle's checks then cover the honest blocks.

Everything runs on loopback. The listener and the NIXL attacker need NIXL: where its probe
fails, :func:`prepare` says why and the soak runs without them (the summary says so).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kvtierd.client import Client, KvtierError, connect
from kvtierd.client.endpoint import client_tls_context
from kvtierd.client.sync import connect_tcp
from kvtierd.nixl.probe import probe_nixl
from kvtierd.store.records import PAGE_BYTES
from kvtierd.testing import DaemonProcess, nixl_reader
from kvtierd.testing.soak import (
    HOSTILE_BLOCK_BYTES,
    HOSTILE_NAMESPACE,
    UNIVERSE,
    Findings,
    block_content,
    key_of,
)

__all__ = ["NIXL_NAMESPACE", "REMOTE_UID", "RemoteAttacker", "RemoteSetup", "prepare"]

#: The uid the hostile tenant's certificate acts as: listed for that tenant only.
REMOTE_UID = 4242
#: The hostile tenant's namespace the NIXL attacker leases from (blocks of
#: :mod:`kvtierd.testing.nixl_reader`'s making, so that the child knows them).
NIXL_NAMESPACE = "crash-hostile-nixl"
#: The hostile tenant's own block size: a size class of its own would need an NVMe segment
#: (64 MiB) of its own, which the soak's 128 MiB tier, split between the two tenants' classes,
#: does not have (its write-back would fail, and with it every FSYNC).
NIXL_BLOCK = HOSTILE_BLOCK_BYTES
NIXL_COUNT = 4
#: ``[name, offset from the hostile region's base, length]``, pulled in this order.
NIXL_PROBES = [
    ["own", 0, NIXL_BLOCK],
    ["after", 8 << 20, 32 << 20],
    ["below", -(64 << 20), 64 << 20],
    ["unmapped", 0, 4096],
]
#: The longest an attack's socket waits for the daemon: the daemon answers or closes long before.
SOCKET_TIMEOUT_S = 10.0
NIXL_CHILD_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class RemoteSetup:
    """Certificates (``tls/``: the CA's and the server's, ``hostile/`` listed for the hostile
    tenant, ``stranger/`` of another CA) and the port the daemons listen on."""

    tls: Path
    port: int

    def config_text(self) -> str:
        pem = self.tls / "server.pem"
        return f"""
[nixl]
enabled = true

[remote]
listen = "127.0.0.1:{self.port}"
cert_file = "{pem}"
key_file = "{pem}"
ca_file = "{self.tls / "ca.pem"}"
clients = [{{name = "hostile-engine", uid = {REMOTE_UID}}}]
"""

    def tls_context(self, who: str) -> ssl.SSLContext:
        pem = self.tls / who / "client.pem"
        return client_tls_context(self.tls / who / "ca.pem", pem, pem)

    def connect(self, who: str = "hostile") -> Client:
        return connect_tcp(
            "127.0.0.1", self.port, tls=self.tls_context(who), timeout_s=SOCKET_TIMEOUT_S
        )


def prepare(directory: Path) -> tuple[RemoteSetup | None, str]:
    """The set-up, or ``None`` and why there is none (NIXL missing or failing its probe)."""
    verdict = probe_nixl()
    if not verdict.ok:
        return None, f"NIXL failed its probe: {verdict.detail}"
    import trustme

    tls = directory / "tls"  # beside the daemon's socket and data: removed with them
    tls.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    ca.cert_pem.write_to_path(tls / "ca.pem")
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(tls / "server.pem")
    for name, issuer in (("hostile", ca), ("stranger", trustme.CA())):
        folder = tls / name
        folder.mkdir(exist_ok=True)
        ca.cert_pem.write_to_path(folder / "ca.pem")
        cert = issuer.issue_cert("hostile-engine.clients", common_name="hostile-engine")
        cert.private_key_and_cert_chain_pem.write_to_path(folder / "client.pem")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return RemoteSetup(tls, port), ""


def _client_hello() -> bytes:
    """The first flight of a TLS client: what a handshake that is cut off has sent."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_side=False)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


class RemoteAttacker:
    """One attack on the TCP listener per :meth:`step` (module docstring)."""

    ATTACKS: ClassVar[dict[str, float]] = {
        "close_early": 0.15,
        "half_hello": 0.15,
        "junk": 0.15,
        "reset": 0.15,
        "other_ca": 0.1,
        "idle_flood": 0.1,
        "create_namespace": 0.1,
        "write_over_tcp": 0.1,
    }

    def __init__(self, loop: Findings, setup: RemoteSetup, rng: random.Random) -> None:
        self.loop = loop
        self.setup = setup
        self.rng = rng
        self.hello = _client_hello()

    def step(self) -> None:
        kind = self.rng.choices(list(self.ATTACKS), weights=list(self.ATTACKS.values()))[0]
        getattr(self, kind)()
        self.loop.action(f"remote_{kind}")

    @contextlib.contextmanager
    def _socket(self) -> Iterator[socket.socket]:
        sock = socket.create_connection(("127.0.0.1", self.setup.port), SOCKET_TIMEOUT_S)
        try:
            yield sock
        finally:
            sock.close()

    def close_early(self) -> None:
        with self._socket():
            pass

    def half_hello(self) -> None:
        with self._socket() as sock:
            sock.sendall(self.hello[: self.rng.randrange(1, len(self.hello))])

    def junk(self) -> None:
        with self._socket() as sock:
            sock.sendall(self.rng.randbytes(self.rng.randint(1, 4096)))
            self.loop.outcome(f"junk_{_fate(sock)}")

    def reset(self) -> None:
        with self._socket() as sock:
            if self.rng.random() < 0.5:
                sock.sendall(self.hello)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def other_ca(self) -> None:
        """A certificate with a listed name from a CA the daemon does not trust."""
        self._refused("other_ca", lambda: self.setup.connect("stranger").close())

    def idle_flood(self) -> None:
        """Connections that never send a byte, held for a moment, then dropped."""
        held: list[socket.socket] = []
        try:
            for _ in range(self.rng.randint(8, 96)):
                try:
                    held.append(socket.create_connection(("127.0.0.1", self.setup.port), 1.0))
                except OSError:
                    self.loop.outcome("idle_flood_refused")
                    break
            time.sleep(self.rng.uniform(0.01, 0.2))
        finally:
            for sock in held:
                sock.close()
        self.loop.outcome("idle_flood_held", len(held))

    def create_namespace(self) -> None:
        """A TCP client may not create a namespace (``remote.allow_create`` is off)."""
        name = f"remote-made-{self.rng.getrandbits(32):08x}"

        def create(client: Client) -> object:
            return client.namespace(name, block_bytes=4096, tenant="hostile")

        self._refused("create_namespace", lambda: _with(self.setup, create))

    def write_over_tcp(self) -> None:
        """A TCP client may not write, not even into its own tenant."""

        def write(client: Client) -> object:
            ns = client.namespace(
                HOSTILE_NAMESPACE, block_bytes=HOSTILE_BLOCK_BYTES, tenant="hostile"
            )
            key = b"remote-write" + self.rng.randbytes(4)
            ns.put([key], [bytes(HOSTILE_BLOCK_BYTES)])
            return None

        self._refused("write_over_tcp", lambda: _with(self.setup, write))

    def _refused(self, kind: str, attempt: Callable[[], object]) -> None:
        """Run ``attempt``, which the daemon must refuse (any refusal is an outcome)."""
        try:
            attempt()
        except (KvtierError, OSError, ssl.SSLError) as exc:
            self.loop.outcome(f"{kind}_{type(exc).__name__}")
            return
        self.loop.defence_failed(f"the TCP listener allowed {kind}")


def _with(setup: RemoteSetup, use: Callable[[Client], object]) -> object:
    with setup.connect() as client:
        return use(client)


def _fate(sock: socket.socket) -> str:
    """How the daemon ended a connection that sent junk: ``closed``, ``reset`` or ``open``."""
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return "open"
    except ConnectionResetError:
        return "reset"
    return "closed"


def store_nixl_blocks(daemon: DaemonProcess) -> None:
    """The hostile tenant's blocks the NIXL attacker leases (through the Unix socket: a TCP
    client cannot write)."""
    with connect(daemon.socket, timeout_s=30) as client:
        ns = client.namespace(NIXL_NAMESPACE, block_bytes=NIXL_BLOCK, tenant="hostile")
        blocks = [
            nixl_reader.block_content(NIXL_NAMESPACE, i, NIXL_BLOCK) for i in range(NIXL_COUNT)
        ]
        ns.put(nixl_reader.block_keys(NIXL_NAMESPACE, NIXL_COUNT), blocks)


def nixl_attack(loop: Findings, setup: RemoteSetup, daemon: DaemonProcess, number: int) -> None:
    """One widened-grant NIXL attack (module docstring); its findings go to ``loop``."""
    over_tcp = number % 2 == 0
    store_nixl_blocks(daemon)
    out = daemon.directory.parent / f"{daemon.directory.name}-nixl-{number}"
    out.mkdir(exist_ok=True)
    env = dict(os.environ, KVTIERD_TEST_OUT=str(out), KVTIERD_TEST_PROBES=json.dumps(NIXL_PROBES))
    if over_tcp:
        env.update(KVTIERD_TEST_TLS=str(setup.tls / "hostile"), UCX_TLS="tcp")
        where = f"tls://127.0.0.1:{setup.port}"
    else:
        where = str(daemon.socket)
    args = [where, "hostile", NIXL_NAMESPACE, str(NIXL_BLOCK), str(NIXL_COUNT), "widen"]
    transport = "tcp" if over_tcp else "local"
    command = [sys.executable, "-m", "kvtierd.testing.nixl_reader", *args]
    try:
        child = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=NIXL_CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        loop.violation(f"cycle {number}: the NIXL attacker ({transport}) hung")
        return
    result = _last_json(child.stdout)
    if result is None or result.get("error"):
        loop.violation(
            f"cycle {number}: the NIXL attacker ({transport}) failed before its probes: "
            f"{result and result.get('error')} {child.stderr[-400:]!r}"
        )
        return
    evidence = False
    for name, failure in result["probes"].items():
        loop.outcome(f"nixl_{transport}_{name}_{'error' if failure else 'bytes'}")
        found = _honest_blocks_in((out / f"{name}.bin").read_bytes(), loop)
        if found:
            loop.defence_failed(
                f"cycle {number}: the NIXL attacker ({transport}) read {found} honest block(s) "
                f"through probe {name!r} (what it read is kept in {out})"
            )
            evidence = True
    if not evidence:  # about 100 MB a cycle of what the probes read
        shutil.rmtree(out, ignore_errors=True)
    loop.action(f"nixl_widen_{transport}")
    _still_serves(loop, setup, daemon, number)


def _honest_blocks_in(data: bytes, loop: Findings) -> int:
    """How many honest blocks start at a page boundary of ``data`` (slots are page-aligned)."""
    prefixes = {block_content(key_of(i))[:32] for i in range(UNIVERSE)}
    pages = np.frombuffer(data[: len(data) // PAGE_BYTES * PAGE_BYTES], np.uint8)
    heads = pages.reshape(-1, PAGE_BYTES)[:, :32]
    return sum(bytes(head) in prefixes for head in heads)


def _still_serves(loop: Findings, setup: RemoteSetup, daemon: DaemonProcess, number: int) -> None:
    """After an attack the daemon runs and serves its Unix socket and its TCP listener."""
    if not daemon.running:
        loop.violation(f"cycle {number}: the daemon exited after the NIXL attack")
        return
    try:
        with connect(daemon.socket, timeout_s=30) as client:
            client.stats()
        with setup.connect() as remote:
            remote.namespace(NIXL_NAMESPACE, block_bytes=NIXL_BLOCK, tenant="hostile")
    except (KvtierError, OSError) as exc:
        loop.violation(f"cycle {number}: the daemon stopped serving after the NIXL attack: {exc!r}")


def _last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            if isinstance(value, dict):
                return value
    return None
