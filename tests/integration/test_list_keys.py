"""LIST_KEYS against the real daemon: paging many keys, keys that change between pages, bounds,
and tenant access, as real other uids."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtierd.client import Client, connect, connect_async
from kvtierd.errors import AccessDeniedError, BlockNotFoundError, InvalidRequestError
from kvtierd.keys import chain_keys
from kvtierd.protocol import MAX_KEYS_PER_REQUEST
from kvtierd.testing import DaemonProcess
from tests.support.configs import config_text, tenant_table
from tests.support.uids import client_as, reachable_directory, require_root

BLOCK = 4096


def _store(client: Client, name: str, n: int, **options: Any) -> tuple[int, list[bytes]]:
    """``n`` blocks in namespace ``name``: its LIST_NS id and the keys."""
    ns = client.namespace(name, block_bytes=BLOCK, **options)
    keys = chain_keys(range(16 * n), 16, ns.key_salt)
    blocks = np.zeros((n, BLOCK), np.uint8)
    for start in range(0, n, 1024):
        ns.put(keys[start : start + 1024], list(blocks[start : start + 1024]))
    ns_id = next(i["ns"] for i in client.namespaces() if i["name"] == name)
    return ns_id, keys


def _pages(client: Client, ns: int, limit: int, after: bytes = b"") -> Iterator[dict[str, Any]]:
    while True:
        page = client.list_keys(ns, after=after, limit=limit)
        yield page
        if not page["more"]:
            return
        after = page["keys"][-1]["key"]


def test_paging_lists_every_key_once_in_byte_order(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns, keys = _store(client, "many", 2500)
        pages = list(_pages(client, ns, 1000))
    assert [len(p["keys"]) for p in pages] == [1000, 1000, 500]
    assert [p["more"] for p in pages] == [True, True, False]
    listed = [k["key"] for p in pages for k in p["keys"]]
    assert listed == sorted(keys)
    assert all(p["blocks"] == 2500 for p in pages)
    first = pages[0]["keys"][0]
    assert (first["dram"], first["pool"], first["raw_bytes"]) == (True, False, BLOCK)


def test_tiers_and_write_back_state_are_those_of_each_block(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns, _ = _store(client, "durable", 3)
        idle_ns, _ = _store(client, "idle", 20)  # enough that a page probes their rows together
        client.fsync()
        client.evict()  # idle on NVMe only: listed from their rows
        [page] = _pages(client, ns, 10)
        [idle] = _pages(client, idle_ns, 30)
    assert {(k["dram"], k["nvme"], k["dirty"]) for k in page["keys"]} == {(False, True, False)}
    assert len(idle["keys"]) == 20
    assert {
        (k["dram"], k["nvme"], k["pool"], k["dirty"], k["raw_bytes"]) for k in idle["keys"]
    } == {(False, True, False, False, BLOCK)}


def test_keys_changing_between_pages(daemon: DaemonProcess) -> None:
    """Keys present throughout are listed once; one forgotten ahead of the cursor is not
    listed; none is listed twice."""
    with connect(daemon.socket) as client:
        ns, keys = _store(client, "changing", 300)
        handle = client.namespace("changing", block_bytes=BLOCK)
        ordered = sorted(keys)
        first = client.list_keys(ns, limit=100)
        ahead, behind = ordered[250], ordered[10]
        assert handle.forget([ahead, behind]) == 2
        _, extra = _store(client, "changing-2", 1)  # another namespace: not listed here
        rest = list(_pages(client, ns, 100, first["keys"][-1]["key"]))
    listed = [k["key"] for k in first["keys"]] + [k["key"] for p in rest for k in p["keys"]]
    assert len(listed) == len(set(listed))
    assert ahead not in listed
    assert behind in listed  # it was on the first page, before it went
    assert set(listed) == set(keys) - {ahead}
    assert extra[0] not in listed
    assert rest[-1]["blocks"] == 298


def test_a_page_after_the_last_key_is_empty(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns, keys = _store(client, "tail", 2)
        page = client.list_keys(ns, after=max(keys))
        assert (page["keys"], page["more"]) == ([], False)
        empty = client.namespace("empty", block_bytes=BLOCK)
        empty_id = next(i["ns"] for i in client.namespaces() if i["name"] == "empty")
        assert client.list_keys(empty_id)["keys"] == []
        assert empty.lookup(keys) == 0


@pytest.mark.parametrize("limit", [0, MAX_KEYS_PER_REQUEST + 1, 1 << 40])
def test_a_limit_out_of_bounds_is_einval_and_the_connection_goes_on(
    daemon: DaemonProcess, limit: int
) -> None:
    with connect(daemon.socket) as client:
        ns, _ = _store(client, f"bounds-{limit}", 1)
        with pytest.raises(InvalidRequestError, match="LIST_KEYS"):
            client.list_keys(ns, limit=limit)
        assert len(client.list_keys(ns, limit=MAX_KEYS_PER_REQUEST)["keys"]) == 1


def test_an_unknown_namespace_is_enoent(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client, pytest.raises(BlockNotFoundError, match="no namespace"):
        client.list_keys(999)


@pytest.mark.anyio
async def test_the_async_client_pages_the_same(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns, keys = _store(client, "async", 5)
    async with connect_async(daemon.socket) as aclient:
        page = await aclient.list_keys(ns, limit=3)
        rest = await aclient.list_keys(ns, after=page["keys"][-1]["key"], limit=3)
    assert [k["key"] for k in page["keys"] + rest["keys"]] == sorted(keys)
    assert (page["more"], rest["more"]) == (True, False)


# -- tenants ---------------------------------------------------------------------------------

ALPHA, BETA = 2001, 2002
TENANTS = config_text(
    tenant_table("alpha", uids=(ALPHA,)),
    tenant_table("beta", uids=(BETA,)),
    daemon={"socket_mode": "0666"},
)


@pytest.fixture
def tenant_daemon() -> Iterator[DaemonProcess]:
    require_root()
    with reachable_directory() as directory:
        process = DaemonProcess(directory, config_text=TENANTS).start()
        try:
            yield process
        finally:
            process.kill()


def store_as_tenant(client: Client, tenant: str) -> tuple[int, list[bytes]]:
    return _store(client, "secret", 2, tenant=tenant)


def list_keys_of(client: Client, ns: int) -> list[bytes]:
    return [k["key"] for k in client.list_keys(ns)["keys"]]


def test_a_tenant_lists_its_own_keys_and_not_another_tenants(
    tenant_daemon: DaemonProcess,
) -> None:
    socket = tenant_daemon.socket
    ns, keys = client_as(ALPHA, ALPHA, socket, store_as_tenant, "alpha")
    assert client_as(ALPHA, ALPHA, socket, list_keys_of, ns) == sorted(keys)
    with pytest.raises(AccessDeniedError, match=f"may not list namespace {ns}"):
        client_as(BETA, BETA, socket, list_keys_of, ns)
    with connect(socket) as root:  # root (the daemon's own uid here) sees every tenant
        assert list_keys_of(root, ns) == sorted(keys)
