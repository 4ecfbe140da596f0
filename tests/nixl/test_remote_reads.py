"""Remote reads: a client on another "host" (a network namespace on a veth pair, as the pool
tests use) opens the daemon over TCP with TLS and pulls blocks over NIXL
(``docs/remote.md``).

The daemon runs in ``hosts[0]`` with ``remote.listen`` on that host's address; every reader is a
child in ``hosts[1]`` (:mod:`kvtierd.testing.nixl_reader`, ``tls://``) with a certificate of its
own, and UCX restricted to TCP on the reader's side (``UCX_TLS=tcp``) so that the bytes cannot take
shared memory: the reader's ``eth0`` counts them. The pytest process stores the blocks through the
daemon's Unix socket (a file: reachable from any namespace) and never loads NIXL. Where namespaces
cannot be made the lab runs over loopback (the same tests, no veth).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from kvtierd.client import Client, Namespace, connect
from kvtierd.config import RemoteConfig, load_config
from kvtierd.errors import ConfigError
from kvtierd.nixl.probe import NixlVerdict
from kvtierd.testing import DaemonProcess, free_port
from kvtierd.testing.netns import LoopbackLab, NetnsLab, open_lab
from kvtierd.testing.nixl_reader import TWO_TENANTS, block_content, block_keys
from tests.nixl.children import Child

pytestmark = pytest.mark.timeout(300)

BLOCK = 1 << 20
COUNT = 4
#: Certificates (common names) the daemon lists, and the uid each acts as.
CLIENTS = {"engine-a": 2001, "engine-b": 2002}


def _config(address: str, port: int, tls: Path) -> str:
    clients = ", ".join(f'{{name = "{name}", uid = {uid}}}' for name, uid in CLIENTS.items())
    return (
        f"""
[dram]
size = "40M"

[nixl]
enabled = true

[remote]
listen = "{address}:{port}"
cert_file = "{tls / "server.pem"}"
key_file = "{tls / "server.pem"}"
ca_file = "{tls / "ca.pem"}"
clients = [{clients}]
"""
        + TWO_TENANTS
    )


def _certificates(directory: Path, server_address: str) -> None:
    """``server.pem`` and ``ca.pem``, and a folder per client (``ca.pem``, ``client.pem``):
    the listed ``engine-a`` and ``engine-b``, ``stranger`` (signed by the CA, not listed) and
    ``forged`` (an ``engine-a`` certificate from another CA)."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(directory / "ca.pem")
    ca.issue_cert(server_address).private_key_and_cert_chain_pem.write_to_path(
        directory / "server.pem"
    )
    other = trustme.CA()
    for name, issuer, common_name in (
        ("engine-a", ca, "engine-a"),
        ("engine-b", ca, "engine-b"),
        ("stranger", ca, "stranger"),
        ("forged", other, "engine-a"),
    ):
        folder = directory / name
        folder.mkdir()
        ca.cert_pem.write_to_path(folder / "ca.pem")
        cert = issuer.issue_cert(f"{common_name}.clients", common_name=common_name)
        cert.private_key_and_cert_chain_pem.write_to_path(folder / "client.pem")


class Remote:
    """The lab, its daemon on ``hosts[0]`` and where readers find it."""

    def __init__(self, lab: NetnsLab | LoopbackLab, daemon: DaemonProcess, port: int) -> None:
        self.lab = lab
        self.daemon = daemon
        self.server, self.reader_host = lab.hosts[0], lab.hosts[1]
        self.url = f"tls://{self.server.address}:{port}"
        self.tls = daemon.directory / "tls"

    def reader(self, name: str, case: str, tenant: str, certificate: str,
               url: str | None = None) -> Child:  # fmt: skip
        args = [url or self.url, tenant, name, str(BLOCK), str(COUNT), case]
        return Child(
            *args,
            module="kvtierd.testing.nixl_reader",
            prefix=self.reader_host.command_prefix,
            env={"KVTIERD_TEST_TLS": str(self.tls / certificate), "UCX_TLS": "tcp"},
        )


@pytest.fixture(scope="module")
def remote(nixl_verdict: NixlVerdict, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Remote]:
    if not nixl_verdict.ok:
        pytest.skip(f"NIXL failed its probe: {nixl_verdict.detail}")
    directory = tmp_path_factory.mktemp("remote")
    with open_lab(directory / "lab", hosts=2) as lab:
        host = lab.hosts[0]
        (directory / "tls").mkdir()
        _certificates(directory / "tls", host.address)
        port = free_port()
        daemon = DaemonProcess(
            directory,
            dram_size=None,
            config_text=_config(host.address, port, directory / "tls"),
            command_prefix=host.command_prefix,
        ).start(120)
        try:
            yield Remote(lab, daemon, port)
        finally:
            daemon.kill()


@pytest.fixture
def client(remote: Remote) -> Iterator[Client]:
    with connect(remote.daemon.socket) as c:
        yield c


def _store(client: Client, name: str, tenant: str) -> tuple[Namespace, list[str]]:
    ns = client.namespace(name, block_bytes=BLOCK, tenant=tenant)
    blocks = [block_content(name, i, BLOCK) for i in range(COUNT)]
    ns.put(block_keys(name, COUNT), blocks)
    return ns, [hashlib.sha256(b).hexdigest() for b in blocks]


def _finish(child: Child) -> dict[str, object]:
    result = child.result()
    child.finish()
    return result


def test_a_remote_pull_is_byte_exact_and_crosses_the_network(
    remote: Remote, client: Client
) -> None:
    _, expected = _store(client, "far", "alpha")
    before = remote.reader_host.link_stats()
    result = _finish(remote.reader("far", "pull", "alpha", "engine-a"))
    assert (result["error"], result["sha256"]) == ("", expected)
    if isinstance(remote.lab, NetnsLab):  # the bytes came in through the reader's eth0
        received = remote.reader_host.link_stats()["rx_bytes"] - before["rx_bytes"]
        assert received >= COUNT * BLOCK


def test_a_certificate_acts_as_its_tenant_only(remote: Remote, client: Client) -> None:
    _store(client, "alphas", "alpha")
    _, expected = _store(client, "betas", "beta")
    own = _finish(remote.reader("betas", "pull", "beta", "engine-b"))
    assert (own["error"], own["sha256"]) == ("", expected)
    theirs = _finish(remote.reader("alphas", "pull", "alpha", "engine-b"))
    assert str(theirs["error"]).startswith("AccessDeniedError")


def test_a_certificate_not_listed_is_refused(remote: Remote, client: Client) -> None:
    _store(client, "strangers", "alpha")
    result = _finish(remote.reader("strangers", "pull", "alpha", "stranger"))
    assert str(result["error"]).startswith("AccessDeniedError")
    assert "'stranger' is not a client of this daemon" in str(result["error"])


@pytest.mark.parametrize(
    ("certificate", "scheme", "expected"),
    [("forged", "tls", "remote.ca_file"), ("engine-a", "tcp", "want TLS")],
    ids=["forged", "plain"],
)
def test_a_client_without_a_trusted_certificate_gets_nothing(
    remote: Remote, client: Client, certificate: str, scheme: str, expected: str
) -> None:
    """A certificate of another CA, or no TLS at all: the handshake fails, nothing is served,
    and the daemon serves on."""
    _store(client, "forgeries", "alpha")
    url = remote.url.replace("tls://", f"{scheme}://")
    result = _finish(remote.reader("forgeries", "pull", "alpha", certificate, url=url))
    assert str(result["error"]).startswith("BrokenConnectionError")
    assert expected in str(result["error"])
    assert "sha256" not in result
    with connect(remote.daemon.socket) as fresh:  # the daemon serves on
        ns = fresh.namespace("forgeries", block_bytes=BLOCK, tenant="alpha", create=False)
        assert ns.lookup(block_keys("forgeries", COUNT)) == COUNT


@pytest.mark.parametrize("case", ["write", "read"])
def test_a_remote_client_neither_writes_nor_maps_memory(
    remote: Remote, client: Client, case: str
) -> None:
    ns, _ = _store(client, f"untouched-{case}", "alpha")
    result = _finish(remote.reader(f"untouched-{case}", case, "alpha", "engine-a"))
    assert str(result["error"]).startswith("NotSupportedError")
    with ns.get(block_keys(f"untouched-{case}", COUNT)) as views:
        got = [hashlib.sha256(v).hexdigest() for v in views]
    expected = [block_content(f"untouched-{case}", i, BLOCK) for i in range(COUNT)]
    assert got == [hashlib.sha256(b).hexdigest() for b in expected]


@pytest.mark.parametrize("runtime", ["asyncio", "trio"])
def test_plaintext_where_the_daemon_allows_it(
    nixl_verdict: NixlVerdict, tmp_path: Path, runtime: str
) -> None:
    """``remote.allow_plaintext``: no TLS, every client acts as ``plaintext_uid`` (here
    tenant alpha's uid); on loopback, since it is what a single test host would do. On both
    runtimes (the TLS daemon above runs on asyncio)."""
    if not nixl_verdict.ok:
        pytest.skip(f"NIXL failed its probe: {nixl_verdict.detail}")
    port = free_port()
    text = f"""
[dram]
size = "40M"

[nixl]
enabled = true

[remote]
listen = "127.0.0.1:{port}"
allow_plaintext = true
plaintext_uid = 2001
{TWO_TENANTS}"""
    daemon = DaemonProcess(tmp_path, dram_size=None, config_text=text, runtime=runtime)
    daemon.start(120)
    try:
        with connect(daemon.socket) as local:
            _, expected = _store(local, "plain", "alpha")
        url = f"tcp://127.0.0.1:{port}"
        reader = Child(url, "alpha", "plain", str(BLOCK), str(COUNT), "pull",
                       module="kvtierd.testing.nixl_reader")  # fmt: skip
        result = _finish(reader)
        assert result["error"] == "", daemon.log()[-3000:]
        assert result["sha256"] == expected
    finally:
        daemon.kill()


# -- configuration -----------------------------------------------------------------------------


def test_remote_listen_needs_tls_or_an_explicit_plaintext() -> None:
    with pytest.raises(ConfigError, match="allow_plaintext"):
        RemoteConfig(listen="10.0.0.1:7000")
    with pytest.raises(ConfigError, match="plaintext_uid"):
        RemoteConfig(listen="10.0.0.1:7000", allow_plaintext=True)
    with pytest.raises(ConfigError, match="key_file"):
        RemoteConfig(listen="10.0.0.1:7000", cert_file="c.pem", ca_file="ca.pem")
    with pytest.raises(ConfigError, match="not host:port"):
        RemoteConfig(listen="10.0.0.1", allow_plaintext=True, plaintext_uid=7)


def test_remote_listen_needs_nixl(tmp_path: Path) -> None:
    path = tmp_path / "kvtierd.toml"
    path.write_text(
        '[remote]\nlisten = "127.0.0.1:7000"\nallow_plaintext = true\nplaintext_uid = 7\n'
    )
    with pytest.raises(ConfigError, match=r"needs nixl\.enabled"):
        load_config(path)
