"""A daemon listening on TCP with TLS (``remote.listen``) on loopback, its certificates, and
clients good and bad: what the tests of hostile connections and of the descriptor budget
share (``tests/nixl/test_remote_reads.py`` runs the same set-up across network namespaces).

``remote.listen`` needs ``nixl.enabled``; where NIXL is missing or fails its probe the daemon
serves on without it, which these tests do not need: they exercise the listener, not reads.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import trustme

from kvtierd.client import Client, client_tls_context, connect
from kvtierd.client.sync import connect_tcp

#: The client certificate the daemon lists, and the uid (tenant ``alpha``) it acts as.
CLIENT = "engine-a"
CLIENT_UID = 2001
#: A second listed client (certificate ``second``), another tenant's uid (no region of its own).
SECOND_CLIENT = "engine-b"
SECOND_UID = 2002
DEADLINE_S = 30.0  # generous: only a daemon that never answers reaches it


@dataclass(frozen=True)
class Certificates:
    """Files under ``directory``: the daemon's, two listed clients' (signed by the daemon's CA:
    ``client`` and ``second``), and a client whose certificate another CA signed."""

    directory: Path

    @classmethod
    def make(cls, directory: Path) -> Certificates:
        directory.mkdir(parents=True, exist_ok=True)
        ca, other = trustme.CA(), trustme.CA()
        ca.cert_pem.write_to_path(directory / "ca.pem")
        other.cert_pem.write_to_path(directory / "other-ca.pem")
        server = ca.issue_cert("127.0.0.1")
        server.private_key_and_cert_chain_pem.write_to_path(directory / "server.pem")
        for name, issuer, common in (
            ("client", ca, CLIENT),
            ("forged", other, CLIENT),
            ("second", ca, SECOND_CLIENT),
        ):
            cert = issuer.issue_cert(f"{common}.clients", common_name=common)
            cert.private_key_and_cert_chain_pem.write_to_path(directory / f"{name}.pem")
        return cls(directory)

    def remote_section(self, port: int, extra: str = "") -> str:
        """``[remote]`` on 127.0.0.1:``port``, and ``[nixl]`` (which it needs)."""
        d = self.directory
        return f"""
[nixl]
enabled = true

[remote]
listen = "127.0.0.1:{port}"
cert_file = "{d / "server.pem"}"
key_file = "{d / "server.pem"}"
ca_file = "{d / "ca.pem"}"
clients = [
  {{name = "{CLIENT}", uid = {CLIENT_UID}}},
  {{name = "{SECOND_CLIENT}", uid = {SECOND_UID}}},
]
{extra}
[[tenants]]
name = "alpha"
uids = [{CLIENT_UID}]
dram_size = "16M"
"""

    def client_context(self, certificate: str = "client") -> ssl.SSLContext:
        """TLS as the client library does it, with ``certificate`` (``client``, ``forged``)."""
        d = self.directory
        return client_tls_context(d / "ca.pem", d / f"{certificate}.pem", d / f"{certificate}.pem")

    def context_without_certificate(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.directory / "ca.pem"))
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context

    def context_distrusting_the_daemon(self) -> ssl.SSLContext:
        """A client that trusts another CA: it aborts the handshake with an alert."""
        d = self.directory
        context = ssl.create_default_context(cafile=str(d / "other-ca.pem"))
        context.load_cert_chain(str(d / "client.pem"))
        return context

    def connect(self, port: int, certificate: str = "client") -> Client:
        """The client library over TLS, as a listed client (``client`` or ``second``)."""
        tls = self.client_context(certificate)
        return connect_tcp("127.0.0.1", port, tls=tls, timeout_s=DEADLINE_S)


def client_hello() -> bytes:
    """The first flight of a TLS client: a real ClientHello, as a scanner would send it."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):  # it waits for the server's answer
        tls.do_handshake()
    return outgoing.read()


def tcp(port: int, source: str = "") -> socket.socket:
    """A connection to 127.0.0.1:``port``, from ``source`` (another loopback address such as
    127.0.0.2: another host, as far as the daemon can tell) when it is given."""
    source_address = (source, 0) if source else None
    sock = socket.create_connection(
        ("127.0.0.1", port), timeout=DEADLINE_S, source_address=source_address
    )
    return sock


def reset(sock: socket.socket) -> None:
    """Close ``sock`` with an RST instead of a FIN (``SO_LINGER`` 0)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def unix_round_trip(path: Path, name: str) -> None:
    """A local engine's PUT and LOOKUP on the daemon's Unix socket; raises if it fails."""
    with connect(path, timeout_s=DEADLINE_S) as client:
        ns = client.namespace(name, block_bytes=4096)
        keys = [bytes([i]) * 16 for i in range(4)]
        ns.put(keys, [np.full(4096, i, np.uint8) for i in range(4)])
        assert ns.lookup(keys) == 4
