"""The two faces of the client are one API: the same methods with the same parameters, on this
host's Unix socket and over TCP+TLS to another host's daemon, with the same errors.

The blocking API is generated from the async one (``python -m tools.unasync_client``; its
check is ``tools/tests/test_unasync_client.py``); these tests hold the faces to that against the
real daemon, so a method hand-added to one face, or a transport that answers differently, fails.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from kvtierd.client import (
    AsyncClient,
    AsyncNamespace,
    Client,
    InvalidRequestError,
    KvtierError,
    Namespace,
    NotSupportedError,
    RemoteProtocolError,
    chain_keys,
    connect,
    connect_async,
    connect_tcp,
    connect_tcp_async,
)
from kvtierd.client.base import check_init
from kvtierd.protocol.messages import InitReply
from kvtierd.testing import DaemonProcess, free_port
from tests.support.tls import DEADLINE_S, Certificates

pytestmark = pytest.mark.timeout(180)

#: What only one face has, by the nature of its transport.
ONLY_SYNC = {"close", "__enter__", "__exit__"}
ONLY_ASYNC = {"aclose"}


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, callable)
        if not name.startswith("_") or name in ("__enter__", "__exit__")
    }


@pytest.mark.parametrize(("sync", "async_"), [(Client, AsyncClient), (Namespace, AsyncNamespace)])
def test_both_faces_have_the_same_methods_and_parameters(sync: type, async_: type) -> None:
    blocking, pipelined = _public(sync), _public(async_)
    assert set(blocking) - ONLY_SYNC == set(pipelined) - ONLY_ASYNC
    for name in set(blocking) - ONLY_SYNC:
        assert blocking[name].parameters.keys() == pipelined[name].parameters.keys(), name


def test_a_lease_acquired_on_either_face_is_released_the_same_way(
    daemon: DaemonProcess, anyio_backend: str
) -> None:
    """``acquire`` (once sync only) holds blocks past one block of code on both faces, and
    ``release()`` from plain code gives them back: the next call sees no lease held."""
    block = np.arange(4096, dtype=np.uint8).tobytes()
    with connect(daemon.socket) as client:
        ns = client.namespace("faces", block_bytes=4096)
        keys = chain_keys(range(32), 16, ns.key_salt)
        ns.put(keys, [block, block])
        lease = ns.acquire(keys)
        assert [bytes(v) for v in lease.views] == [block, block]
        assert client.stats()["leases"] >= 1
        lease.release()
        assert client.stats()["leases"] == 0

    async def main() -> None:
        async with connect_async(daemon.socket) as aclient:
            ans = await aclient.namespace("faces", block_bytes=4096)
            held = await ans.acquire(keys)
            assert [bytes(v) for v in held.views] == [block, block]
            assert (await aclient.stats())["leases"] >= 1
            held.release()  # from synchronous code: the janitor sends the RELEASE
            for _ in range(200):
                if (await aclient.stats())["leases"] == 0:
                    break
                await anyio.sleep(0.01)
            assert (await aclient.stats())["leases"] == 0
            async with ans.lease(keys) as leased:
                assert leased.held
            assert (await aclient.stats())["leases"] == 0  # answered as the block ended
            assert aclient.connected()

    anyio.run(main, backend=anyio_backend)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    directory = tmp_path_factory.mktemp("faces")
    process = DaemonProcess(directory)
    process.start(120)
    try:
        yield process
    finally:
        process.kill()


class _TlsDaemon:
    def __init__(self, directory: Path) -> None:
        self.certs = Certificates.make(directory / "tls")
        self.port = free_port()
        config = self.certs.remote_section(self.port, "allow_create = true\n")
        self.process = DaemonProcess(directory, config_text=config)


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_TlsDaemon]:
    d = _TlsDaemon(tmp_path_factory.mktemp("faces-tls"))
    d.process.start(120)
    try:
        yield d
        assert "Traceback" not in d.process.log(), d.process.log()[-5000:]
    finally:
        d.process.kill()


def _sync_tcp(d: _TlsDaemon, certificate: str) -> dict[str, Any]:
    tls = d.certs.client_context(certificate)
    with connect_tcp("127.0.0.1", d.port, tls=tls, timeout_s=DEADLINE_S) as client:
        return _remote_view(client.stats(), client.connected())


async def _async_tcp(d: _TlsDaemon, certificate: str) -> dict[str, Any]:
    tls = d.certs.client_context(certificate)
    async with connect_tcp_async("127.0.0.1", d.port, tls=tls) as client:
        return _remote_view(await client.stats(), client.connected())


def _remote_view(stats: dict[str, Any], connected: bool) -> dict[str, Any]:
    return {"scope": stats["scope"], "connected": connected}


def test_both_faces_speak_tls_to_a_remote_daemon(
    tls_daemon: _TlsDaemon, anyio_backend: str
) -> None:
    """A listed client certificate: the same tenant-scoped view on both faces."""
    blocking = _sync_tcp(tls_daemon, "client")
    pipelined = anyio.run(_async_tcp, tls_daemon, "client", backend=anyio_backend)
    assert blocking == pipelined == {"scope": "tenant", "connected": True}


def test_both_faces_refuse_a_forged_certificate_alike(
    tls_daemon: _TlsDaemon, anyio_backend: str
) -> None:
    """A certificate for the listed name (``engine-a``) signed by another CA: the same error
    on both faces, naming the daemon's CA setting; the daemon serves on."""
    errors = []
    with pytest.raises(KvtierError, match=r"remote\.ca_file") as blocking:
        _sync_tcp(tls_daemon, "forged")
    errors.append(type(blocking.value))
    with pytest.raises(KvtierError, match=r"remote\.ca_file") as pipelined:
        anyio.run(_async_tcp, tls_daemon, "forged", backend=anyio_backend)
    errors.append(type(pipelined.value))
    assert errors[0] is errors[1]
    assert _sync_tcp(tls_daemon, "client")["scope"] == "tenant"


def test_a_tcp_client_maps_no_region_on_either_face(
    tls_daemon: _TlsDaemon, anyio_backend: str
) -> None:
    """Over TCP no descriptor passes: the arena is refused alike (reads go over NIXL)."""
    tls = tls_daemon.certs.client_context("client")
    with connect_tcp("127.0.0.1", tls_daemon.port, tls=tls, timeout_s=DEADLINE_S) as client:
        ns = client.namespace("remote", block_bytes=4096, tenant="alpha")
        with pytest.raises(NotSupportedError, match="NIXL"):
            ns.arena  # noqa: B018

    async def main() -> None:
        async with connect_tcp_async("127.0.0.1", tls_daemon.port, tls=tls) as aclient:
            ans = await aclient.namespace("remote", block_bytes=4096, tenant="alpha")
            with pytest.raises(NotSupportedError, match="NIXL"):
                ans.arena  # noqa: B018

    anyio.run(main, backend=anyio_backend)


def test_async_leases_are_given_back_from_any_thread_and_before_the_block_is_left(
    daemon: DaemonProcess, anyio_backend: str
) -> None:
    """``release()`` of an async lease from a worker thread reaches the daemon, and leaving an
    ``async with ns.lease()`` block sends its RELEASE before the client's next request, even
    when ``release()`` ran inside it (the janitor may have taken it first): that request finds
    no lease of this connection held."""
    block = np.full(4096, 3, np.uint8).tobytes()

    async def main() -> None:
        with connect(daemon.socket) as observer:
            async with connect_async(daemon.socket) as aclient:
                ans = await aclient.namespace("threads", block_bytes=4096)
                keys = chain_keys(range(48), 16, ans.key_salt)
                await ans.put(keys, [block] * 3)
                held = await ans.acquire(keys)
                assert observer.stats()["leases"] >= 1
                await anyio.to_thread.run_sync(held.release)
                for _ in range(500):
                    if observer.stats()["leases"] == 0:
                        break
                    await anyio.sleep(0.01)
                assert observer.stats()["leases"] == 0
                for _ in range(20):
                    async with ans.lease(keys) as leased:
                        leased.release()
                        await anyio.lowlevel.checkpoint()  # the janitor may take the RELEASE now
                    assert (await aclient.stats())["leases"] == 0

    anyio.run(main, backend=anyio_backend)


def test_a_write_allocated_outside_a_block_is_committed_or_aborted_once(
    daemon: DaemonProcess, anyio_backend: str
) -> None:
    """``allocate`` / ``commit`` / ``abort`` on both faces: committed blocks are stored, aborted
    ones never visible, and a write ends once."""
    block = np.full(4096, 9, np.uint8).tobytes()
    with connect(daemon.socket) as client:
        ns = client.namespace(f"allocated-{anyio_backend}", block_bytes=4096)
        kept, dropped = chain_keys(range(32), 16, ns.key_salt), chain_keys(range(99, 131), 16)
        write = ns.allocate(kept)
        for view in write.views:
            assert view is not None
            view[:] = block
        ns.commit(write)
        with pytest.raises(InvalidRequestError, match="committed already"):
            ns.abort(write)
        ns.abort(ns.allocate(dropped))
        assert (ns.lookup(kept), ns.lookup(dropped)) == (2, 0)

    async def main() -> None:
        async with connect_async(daemon.socket) as aclient:
            ans = await aclient.namespace(f"allocated-{anyio_backend}", block_bytes=4096)
            again = await ans.allocate(kept)
            assert again.views == [None, None]  # stored already: nothing to fill
            await ans.commit(again)
            with pytest.raises(InvalidRequestError, match="committed already"):
                await ans.commit(again)
            await ans.abort(await ans.allocate(dropped))
            assert (await ans.lookup(kept), await ans.lookup(dropped)) == (2, 0)

    anyio.run(main, backend=anyio_backend)


@pytest.fixture(scope="module")
def plaintext_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A daemon whose ``remote.listen`` takes plaintext (a test network's setting)."""
    directory = tmp_path_factory.mktemp("faces-plain")
    port = free_port()
    config = f"""
[nixl]
enabled = true

[remote]
listen = "127.0.0.1:{port}"
allow_plaintext = true
plaintext_uid = 2001
allow_create = true

[[tenants]]
name = "alpha"
uids = [2001]
dram_size = "16M"
"""
    process = DaemonProcess(directory, config_text=config)
    process.start(120)
    try:
        yield port, directory
        assert "Traceback" not in process.log(), process.log()[-5000:]
    finally:
        process.kill()


def test_both_faces_speak_plaintext_tcp_where_the_daemon_allows_it(
    plaintext_daemon: tuple[int, Path], anyio_backend: str
) -> None:
    """Plaintext TCP (anyio's stream on asyncio is no plain socket, so the async face reads and
    writes it through the stream): the same view on both faces, and the connection stays up."""
    port, _ = plaintext_daemon
    with connect_tcp("127.0.0.1", port, tls=None, timeout_s=DEADLINE_S) as client:
        blocking = _remote_view(client.stats(), client.connected())

    async def main() -> dict[str, Any]:
        async with connect_tcp_async("127.0.0.1", port, tls=None) as aclient:
            ns = await aclient.namespace("plain", block_bytes=4096, tenant="alpha")
            assert await ns.lookup([b"\x02" * 16]) == 0
            return _remote_view(await aclient.stats(), aclient.connected())

    assert (
        anyio.run(main, backend=anyio_backend)
        == blocking
        == {
            "scope": "tenant",
            "connected": True,
        }
    )


def test_an_init_reply_allowing_no_key_is_refused() -> None:
    """A peer posing as a daemon that allows 0 keys per request would make every operation
    loop on nothing: refused at INIT as a protocol error."""
    reply = InitReply(1, 9, 1 << 20, 64, 0, 0, "0.0.0")
    with pytest.raises(RemoteProtocolError, match="0 keys per request"):
        check_init(reply)
