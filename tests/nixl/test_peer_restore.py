"""Restoring from a peer daemon before the pool (``remote.peers``, :mod:`kvtierd.server.peers`).

Three "hosts" (network namespaces on a bridge, or loopback): ``hosts[0]`` runs the peer daemon
A (``remote.listen`` with TLS), ``hosts[1]`` the rank daemon B (a one-rank group on the pool,
``remote.peers = [A]``), ``hosts[2]`` the pool's ``redis-server``. Both daemons share one key
secret, as the hosts of a pool must, so one namespace spec has one digest and one set of keys on
both. B writes its blocks to the pool, its disk is wiped and it restarts: its manifest restore
indexes every block as a pool copy. Blocks A also holds then come from A over NIXL (the pool
server counts no GET for them), the others from the pool, and with A gone everything from the
pool again. Every block is compared byte for byte.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from kvtierd.client import Client, connect
from kvtierd.nixl.probe import NixlVerdict
from kvtierd.testing import DaemonProcess
from kvtierd.testing.netns import LoopbackLab, NetnsLab, open_lab
from kvtierd.testing.nixl_reader import block_content, block_keys
from kvtierd.testing.redis_server import RedisServer, require_redis_server

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

BLOCK = 1 << 20
NS = "peer-restore"
PEER_PORT = 7461
#: The uid A's certificate map gives B's certificate, and tenant alpha's.
B_UID = 2001
TENANT = f"""
[[tenants]]
name = "alpha"
uids = [{B_UID}]
dram_size = "24M"
"""


def _peer_config(address: str, tls: Path, secret: Path) -> str:
    # DEBUG: the peer's connection lines (which name the client's certificate) are DEBUG lines
    return f"""
[daemon]
key_secret_file = "{secret}"
log_level = "debug"

[dram]
size = "40M"

[nixl]
enabled = true

[remote]
listen = "{address}:{PEER_PORT}"
cert_file = "{tls / "a.pem"}"
key_file = "{tls / "a.pem"}"
ca_file = "{tls / "ca.pem"}"
clients = [{{name = "kvtierd-b", uid = {B_UID}}}]
{TENANT}"""


def _rank_config(peer: str, pool_url: str, tls: Path, secret: Path) -> str:
    return f"""
[daemon]
key_secret_file = "{secret}"
shutdown_grace_s = 4

[dram]
size = "40M"
prefetch_bytes_per_s = 0

[nixl]
enabled = true

[pool]
url = "{pool_url}"
allow_plaintext = true
group_id = "peers"
vote_timeout_s = 1.0
heartbeat_s = 0.2
timeout_s = 1.0

[remote]
peers = [{{address = "{peer}:{PEER_PORT}"}}]
peer_cert_file = "{tls / "b.pem"}"
peer_key_file = "{tls / "b.pem"}"
peer_ca_file = "{tls / "ca.pem"}"
{TENANT}"""


class Setting:
    def __init__(self, lab: NetnsLab | LoopbackLab, directory: Path, pool: RedisServer) -> None:
        self.lab, self.directory, self.pool = lab, directory, pool
        tls = directory / "tls"
        tls.mkdir()
        ca = trustme.CA()
        ca.cert_pem.write_to_path(tls / "ca.pem")
        ca.issue_cert(lab.hosts[0].address).private_key_and_cert_chain_pem.write_to_path(
            tls / "a.pem"
        )
        ca.issue_cert("kvtierd-b.peers", common_name="kvtierd-b").private_key_and_cert_chain_pem \
            .write_to_path(tls / "b.pem")  # fmt: skip
        secret = directory / "key.secret"  # made by the first daemon to start, then shared
        self.peer = lab.hosts[0].daemon(
            directory / "a",
            dram_size=None,
            config_text=_peer_config(lab.hosts[0].address, tls, secret),
        )
        self.rank_text = _rank_config(lab.hosts[0].address, pool.url, tls, secret)
        self.rank = self._rank()

    def _rank(self) -> DaemonProcess:
        return self.lab.hosts[1].daemon(
            self.directory / "b", dram_size=None, config_text=self.rank_text
        )

    def restart_rank_wiped(self) -> None:
        assert self.rank.stop() == 0, self.rank.log()[-3000:]
        shutil.rmtree(self.directory / "b" / "data")
        self.rank = self._rank().start(120)

    def gets(self) -> int:
        """Blocks the rank has read from the pool (its pool tier's hits: one GET each)."""
        with connect(self.rank.socket) as client:
            tiers = client.stats()["tiers"]
        return int(next(t["hits"] for t in tiers if t["name"] == "pool"))


@pytest.fixture
def setting(
    nixl_verdict: NixlVerdict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Setting]:
    if not nixl_verdict.ok:
        pytest.skip(f"NIXL failed its probe: {nixl_verdict.detail}")
    require_redis_server()
    # NIXL between the daemons over TCP only: shared memory would carry the bytes between two
    # "hosts" of one machine, past the veth pair the test counts them on.
    monkeypatch.setenv("UCX_TLS", "tcp")
    with open_lab(tmp_path / "lab", hosts=3) as lab:
        pool = lab.hosts[2].redis_server(tmp_path / "pool").start()
        made = Setting(lab, tmp_path, pool)
        try:
            made.peer.start(120)
            made.rank.start(120)
            yield made
        finally:
            made.rank.kill()
            made.peer.kill()
            pool.kill()


def _put(client: Client, tag: str, count: int) -> list[bytes]:
    ns = client.namespace(NS, block_bytes=BLOCK, tenant="alpha")
    keys = block_keys(tag, count)
    assert ns.put(keys, [block_content(tag, i, BLOCK) for i in range(count)]) == count
    return keys


def _read(daemon: DaemonProcess, tag: str, count: int) -> None:
    """Read the blocks of ``tag`` through ``daemon`` and compare each with what was written."""
    with connect(daemon.socket) as client:
        ns = client.namespace(NS, block_bytes=BLOCK, tenant="alpha", create=False)
        assert ns.lookup(block_keys(tag, count)) == count
        with ns.get(block_keys(tag, count)) as views:
            got = [hashlib.sha256(v[:BLOCK]).hexdigest() for v in views]
    assert got == [hashlib.sha256(block_content(tag, i, BLOCK)).hexdigest() for i in range(count)]


def test_a_wiped_rank_restores_from_its_peer_before_the_pool(setting: Setting) -> None:
    with connect(setting.rank.socket) as rank, connect(setting.peer.socket) as peer:
        for tag in ("shared", "gone"):  # on both daemons
            _put(rank, tag, 4)
            _put(peer, tag, 4)
        _put(rank, "pool-only", 3)
        rank.fsync()  # write-through: the pool holds every block now
    setting.restart_rank_wiped()

    before = setting.gets()
    link = setting.lab.hosts[1].link_stats()
    _read(setting.rank, "shared", 4)
    assert setting.gets() == before == 0, "blocks the peer holds were fetched from the pool"
    assert "(kvtierd-b)" in setting.peer.log()  # B connected with its own certificate
    if isinstance(setting.lab, NetnsLab):  # and the bytes came in through B's eth0
        assert setting.lab.hosts[1].link_stats()["rx_bytes"] - link["rx_bytes"] >= 4 * BLOCK

    assert setting.rank.process is not None  # B pulled through its exporter: it loads no NIXL
    assert "libucp" not in Path(f"/proc/{setting.rank.process.pid}/maps").read_text()

    _read(setting.rank, "pool-only", 3)
    assert setting.gets() == before + 3  # the peer has none of them: one GET each

    setting.peer.kill()
    _read(setting.rank, "gone", 4)  # the peer is gone: the pool serves, nothing fails
    assert setting.gets() == before + 3 + 4
    assert "peer tls://" in setting.rank.log()
    assert "the pool serves, the peer is skipped" in setting.rank.log()
