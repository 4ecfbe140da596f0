"""The harness the pool tests stand on works for real: servers, TLS, ACL, cluster, the lab."""

from __future__ import annotations

import itertools
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvtierd.testing.netns import (
    LoopbackHost,
    LoopbackLab,
    NetnsHost,
    NetnsLab,
    cleanup_leftovers,
    pid_alive,
    require_netns,
)
from kvtierd.testing.redis_server import (
    RedisCluster,
    RedisServer,
    TlsFiles,
    make_other_ca,
    make_tls,
    require_redis_server,
)

pytestmark = pytest.mark.redis

Lab = NetnsLab | LoopbackLab
Host = NetnsHost | LoopbackHost


def cli(lab_host: Host, server: RedisServer, *args: str, timeout_s: float = 10) -> str:
    """``redis-cli`` run on a lab host against ``server``: its output, or ``ERROR: ...``."""
    argv = ["redis-cli", "-h", server.host, "-p", str(server.port), *server.cli_args(), *args]
    try:
        result = lab_host.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "ERROR: timed out"
    out = (result.stdout + result.stderr).strip()
    return out if result.returncode == 0 and "Could not connect" not in out else f"ERROR: {out}"


def raw(**kwargs: Any) -> redis.Redis:
    """A client built by hand (no retries: a refusal is immediate)."""
    return redis.Redis(retry=Retry(NoBackoff(), 0), socket_timeout=5, **kwargs)


# -- one server ------------------------------------------------------------------------------


def test_server_answers_and_restart_keeps_data(redis_server: RedisServer) -> None:
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}"
    with redis_server.client() as client:
        client.set(b"block", b"\x00kv" * 1000)
    port = redis_server.port
    redis_server.restart()
    assert redis_server.port == port
    with redis_server.client() as client:
        assert client.get(b"block") == b"\x00kv" * 1000


def test_kill_keeps_acknowledged_writes(redis_server: RedisServer) -> None:
    with redis_server.client() as client:
        client.set(b"acked", b"1")
    redis_server.kill()
    assert not redis_server.running
    with (
        redis_server.client(socket_connect_timeout=1) as client,
        pytest.raises(redis.ConnectionError),
    ):
        client.ping()
    redis_server.start()
    with redis_server.client() as client:
        assert client.get(b"acked") == b"1"


def test_without_persistence_a_restart_forgets(tmp_path: Path) -> None:
    require_redis_server()
    with RedisServer(tmp_path / "volatile", persistence=False) as server:
        with server.client() as client:
            client.set(b"k", b"v")
        server.restart()
        with server.client() as client:
            assert client.get(b"k") is None


def test_start_failure_shows_the_log(tmp_path: Path) -> None:
    require_redis_server()
    server = RedisServer(tmp_path / "bad", extra_config=["no-such-directive yes"])
    with pytest.raises(RuntimeError, match="no-such-directive"):
        server.start(timeout_s=5)
    assert not server.running


# -- TLS and ACL -----------------------------------------------------------------------------


def test_tls_right_ca_connects(redis_tls: tuple[RedisServer, TlsFiles]) -> None:
    server, tls = redis_tls
    assert server.url == f"rediss://127.0.0.1:{server.port}"
    with server.client() as client:  # with the client certificate
        assert client.ping()
    # tls-auth-clients optional: the right CA alone is enough
    with raw(host=server.host, port=server.port, ssl=True, ssl_ca_certs=str(tls.ca_cert)) as client:
        assert client.ping()


def test_tls_other_ca_is_refused(redis_tls: tuple[RedisServer, TlsFiles], tmp_path: Path) -> None:
    server, _ = redis_tls
    other = make_other_ca(tmp_path / "other")
    with (
        raw(host=server.host, port=server.port, ssl=True, ssl_ca_certs=str(other)) as client,
        pytest.raises(redis.ConnectionError) as refused,
    ):
        client.ping()
    assert isinstance(refused.value.__cause__, ssl.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(
        refused.value
    ), repr(refused.value)


def test_tls_port_refuses_plaintext(redis_tls: tuple[RedisServer, TlsFiles]) -> None:
    server, _ = redis_tls
    with (
        raw(host=server.host, port=server.port) as client,
        pytest.raises(redis.ConnectionError),
    ):
        client.ping()


def test_tls_client_certificate_required(tmp_path: Path) -> None:
    require_redis_server()
    tls = make_tls(tmp_path / "tls")
    with RedisServer(tmp_path / "mtls", tls=tls, require_client_cert=True) as server:
        with server.client() as client:
            assert client.ping()
        with (
            raw(
                host=server.host, port=server.port, ssl=True, ssl_ca_certs=str(tls.ca_cert)
            ) as client,
            pytest.raises(redis.ConnectionError),
        ):
            client.ping()


def test_acl_refuses_wrong_and_missing_password(redis_acl: tuple[RedisServer, str, str]) -> None:
    server, user, password = redis_acl
    with server.client() as client:
        assert client.acl_whoami() == user
    with server.client(username=user, password=password) as client:
        assert client.ping()
    with (
        server.client(username=user, password=password + "x") as client,
        pytest.raises(redis.AuthenticationError),
    ):
        client.ping()
    with (
        raw(host=server.host, port=server.port) as client,
        pytest.raises(redis.AuthenticationError),
    ):
        client.ping()
    assert password not in server.log()


# -- cluster ---------------------------------------------------------------------------------


def test_cluster_spreads_keys_over_masters(redis_cluster: RedisCluster) -> None:
    assert len(redis_cluster.startup_nodes) == 3
    assert redis_cluster.url == redis_cluster.nodes[0].url
    keys = [f"kv:{index}".encode() for index in range(60)]
    with redis_cluster.client() as client:
        for key in keys:
            client.set(key, key[::-1])
    holding = []
    for node in redis_cluster.nodes:
        with node.client() as client:
            holding.append(client.dbsize())
    assert sum(holding) == len(keys)
    assert sum(1 for count in holding if count) >= 2, holding
    with redis_cluster.client() as client:
        assert [client.get(key) for key in keys] == [key[::-1] for key in keys]


# -- the lab ---------------------------------------------------------------------------------


def test_lab_has_three_hosts(lab: Lab) -> None:
    assert len(lab.hosts) == 3
    addresses = [host.address for host in lab.hosts]
    if lab.kind == "netns":
        assert len(set(addresses)) == 3
        assert len({host.name for host in lab.hosts}) == 3
    else:
        assert addresses == ["127.0.0.1"] * 3
    for host in lab.hosts:
        assert host.run(["true"]).returncode == 0
        assert host.directory.is_dir()


def test_pool_host_server_reachable_from_rank_host(lab: Lab) -> None:
    require_redis_server()
    pool = lab.hosts[2]
    with pool.redis_server() as server:
        assert server.host == pool.address
        assert cli(lab.hosts[0], server, "SET", "from-rank-0", "yes") == "OK"
        with server.client() as client:  # the test process reaches every host
            assert client.get(b"from-rank-0") == b"yes"


def test_netns_traffic_crosses_interfaces(lab: Lab) -> None:
    require_netns()
    require_redis_server()
    rank, pool = lab.hosts[0], lab.hosts[2]
    with pool.redis_server() as server:
        value = "x" * 100_000
        rank_before, pool_before = rank.link_stats(), pool.link_stats()
        assert cli(rank, server, "SET", "big", value) == "OK"
        rank_after, pool_after = rank.link_stats(), pool.link_stats()
    assert rank_after["tx_bytes"] - rank_before["tx_bytes"] >= len(value)
    assert pool_after["rx_bytes"] - pool_before["rx_bytes"] >= len(value)


def _root_global_address() -> str | None:
    words = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "scope", "global"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for before, word in itertools.pairwise(words):
        if before == "inet" and not word.startswith("10."):
            return word.split("/")[0]
    return None


def test_netns_hosts_are_isolated(lab: Lab, tmp_path: Path) -> None:
    require_netns()
    require_redis_server()
    rank, pool = lab.hosts[0], lab.hosts[2]
    # A server on the pool namespace's own loopback: the pool host reaches it, nobody else does.
    private = RedisServer(tmp_path / "private", host="127.0.0.1", persistence=False)
    private.data_dir.mkdir(parents=True)
    private.config_path.write_text("\n".join(private.config_lines()) + "\n")
    with pool.popen(
        ["redis-server", str(private.config_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as process:
        try:
            for _ in range(200):
                if cli(pool, private, "PING") == "PONG":
                    break
                time.sleep(0.05)
            assert cli(pool, private, "PING") == "PONG"
            assert cli(rank, private, "PING").startswith("ERROR")
            with (
                private.client(socket_connect_timeout=1) as client,  # root's 127.0.0.1
                pytest.raises(redis.ConnectionError),
            ):
                client.ping()
        finally:
            process.terminate()
    # A server in the root namespace on its own address: no route to it from a lab host.
    address = _root_global_address()
    if address is not None:
        with RedisServer(tmp_path / "root", host=address, persistence=False) as outside:
            assert cli(rank, outside, "PING", timeout_s=3).startswith("ERROR")


def test_netns_disconnect_and_reconnect(lab: Lab) -> None:
    require_netns()
    require_redis_server()
    rank, pool = lab.hosts[0], lab.hosts[2]
    with pool.redis_server() as server:
        assert cli(rank, server, "PING") == "PONG"
        pool.disconnect()
        try:
            assert cli(rank, server, "PING", timeout_s=2).startswith("ERROR")
        finally:
            pool.reconnect()
        assert cli(rank, server, "PING") == "PONG"


def test_tls_server_on_pool_host(lab: Lab, tmp_path: Path) -> None:
    require_redis_server()
    pool = lab.hosts[2]
    tls = make_tls(tmp_path / "tls", hostnames=[pool.address])
    with pool.redis_server(tls=tls) as server:
        assert server.url == f"rediss://{pool.address}:{server.port}"
        assert cli(lab.hosts[0], server, "PING") == "PONG"
        with server.client() as client:
            assert client.ping()


def test_daemon_runs_on_a_lab_host(lab: Lab) -> None:
    host = lab.hosts[0]
    with host.daemon(dram_size="16M", nvme_size="64M") as daemon:
        assert daemon.command_prefix == host.command_prefix
        assert daemon.running
        if isinstance(host, NetnsHost):  # ip netns exec execs: the pid is the daemon's own
            assert daemon.process is not None
            assert daemon.process.pid in host.pids()
    assert daemon.process is not None
    assert daemon.process.returncode == 0


def test_leftovers_of_a_dead_run_are_removed() -> None:
    require_netns()
    dead = next(pid for pid in range(32000, 300, -1) if not pid_alive(pid))
    netns, bridge, veth = f"kvt{dead}l0h0", f"kvb{dead:x}l0", f"kvv{dead:x}l0h0"
    try:
        subprocess.run(["ip", "netns", "add", netns], check=True)
        subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], check=True)
        subprocess.run(
            ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns],
            check=True,
        )
        removed = cleanup_leftovers()
        assert netns in removed
        assert bridge in removed
        assert veth in removed
        links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
        assert bridge not in links
        assert veth not in links
        assert (
            netns
            not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        )
    finally:
        subprocess.run(["ip", "link", "del", veth], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
