"""The client's surface against a real daemon, both clients: ``block_bytes`` derived from a
layout, the errors of the shapes users get wrong, identity fields and reprs, a closed client on
every path, and what ``connect`` says about a socket path that cannot be the daemon's."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtierd.client import (
    AsyncNamespace,
    ClosedError,
    DaemonNotRunningError,
    InvalidRequestError,
    Layout,
    Namespace,
    chain_keys,
    connect,
    connect_async,
)
from kvtierd.config import parse_size
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.timeout(120)

BLOCK = 4096
#: SmolLM2-135M, one TP rank: 2 x 30 x 3 x 64 x 16 x 2 bytes.
LAYOUT = Layout("HuggingFaceTB/SmolLM2-135M", 30, 3, 64, "bfloat16", 16)
LAYOUT_BYTES = 368640


def _blocks(n: int, size: int = BLOCK) -> list[np.ndarray]:
    return [np.full(size, i + 1, np.uint8) for i in range(n)]


# -- block_bytes from the layout -------------------------------------------------------------


@pytest.mark.parametrize(
    "layout", [LAYOUT, {f: getattr(LAYOUT, f) for f in LAYOUT.__struct_fields__}]
)
def test_block_bytes_is_derived_from_the_layout(daemon: DaemonProcess, layout: Any) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("derived", layout=layout)
        assert ns.block_bytes == LAYOUT_BYTES
        assert ns.layout == LAYOUT
        [info] = [n for n in client.namespaces() if n["name"] == "derived"]
        assert info["block_bytes"] == LAYOUT_BYTES
        keys = chain_keys(range(32), 16, ns.key_salt)
        assert ns.put(keys, _blocks(2, LAYOUT_BYTES)) == 2
        # The same identity with block_bytes given explicitly is the same namespace.
        again = client.namespace("derived", block_bytes=LAYOUT_BYTES, layout=layout)
        assert again.lookup(keys) == 2


@pytest.mark.anyio
async def test_block_bytes_is_derived_from_the_layout_async(daemon: DaemonProcess) -> None:
    async with connect_async(daemon.socket) as client:
        ns = await client.namespace("derived", layout=LAYOUT)
        assert ns.block_bytes == LAYOUT_BYTES
        keys = chain_keys(range(16), 16, ns.key_salt)
        assert await ns.put(keys, _blocks(1, LAYOUT_BYTES)) == 1


def test_block_bytes_against_the_layout_is_checked_before_sending(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        with pytest.raises(InvalidRequestError) as wrong:
            client.namespace("x", block_bytes=LAYOUT_BYTES // 2, layout=LAYOUT)
        assert str(wrong.value) == (
            "block_bytes is 184320 but the layout gives 368640 (2 x layers x kv_heads x "
            "head_dim x block_tokens x dtype size): leave block_bytes out"
        )
        with pytest.raises(InvalidRequestError, match="pass block_bytes, or a layout"):
            client.namespace("x")
        odd = Layout("m", 2, 1, 8, "float4_e2m1", 16)  # a dtype the table does not size
        with pytest.raises(InvalidRequestError, match="dtype 'float4_e2m1' is not known"):
            client.namespace("x", layout=odd)
        assert client.namespace("x", block_bytes=BLOCK, layout=odd).block_bytes == BLOCK
        assert [n["name"] for n in client.namespaces()] == ["x"]  # nothing else was opened


# -- shapes users get wrong ------------------------------------------------------------------


def test_any_integer_sizes_a_namespace_and_a_float_is_refused(daemon: DaemonProcess) -> None:
    """numpy's integers and int subclasses (the config's ``ByteSize``) are integers; a float
    is refused before anything is sent, as a bad option, not a TypeError from the encoder."""
    with connect(daemon.socket) as client:
        ns = client.namespace("i", block_bytes=np.int64(BLOCK), rank=np.int32(0))
        assert ns.block_bytes == BLOCK
        assert client.namespace("s", block_bytes=parse_size("4K")).block_bytes == BLOCK
        with pytest.raises(InvalidRequestError, match="invalid namespace options"):
            client.namespace("f", block_bytes=float(BLOCK))  # type: ignore[arg-type]
        assert sorted(n["name"] for n in client.namespaces()) == ["i", "s"]


def test_a_single_key_or_block_is_refused_saying_so(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(32), 16, ns.key_salt)
        [block] = _blocks(1)
        with pytest.raises(InvalidRequestError) as one_key:
            ns.put(keys[0], block)
        assert str(one_key.value) == ("keys must be a list of keys, not a single bytes: pass [key]")
        with pytest.raises(InvalidRequestError, match=r"not a single ndarray: put\(\[key\]"):
            ns.put([keys[0]], block)
        with pytest.raises(InvalidRequestError, match=r"not a single bytes: put\(\[key\]"):
            ns.put([keys[0]], block.tobytes())
        assert ns.lookup(keys) == 0  # nothing was sent
        assert ns.put([keys[0]], [block]) == 1


def test_str_keys_are_refused_before_encoding(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(32), 16, ns.key_salt)
        calls: list[Callable[[], object]] = [
            lambda: ns.put([keys[0], "k2"], _blocks(2)),
            lambda: ns.lookup([keys[0], "k2"]),
            lambda: ns.lookup_tiers([keys[0], "k2"]),
            lambda: ns.lookup_each([keys[0], "k2"]),
            lambda: ns.read_into([keys[0], "k2"], [bytearray(BLOCK)] * 2),
            lambda: ns.forget([keys[0], "k2"]),
            lambda: ns.acquire([keys[0], "k2"]),
            lambda: ns.write([keys[0], "k2"]).__enter__(),
        ]
        for call in calls:
            with pytest.raises(InvalidRequestError) as refused:
                call()
            assert str(refused.value) == "keys are bytes (from chain_keys), got str at index 1"
        with pytest.raises(InvalidRequestError, match="not a single str"):
            ns.lookup("0123456789abcdef")
        assert client.stats()["leases"] == 0


@pytest.mark.anyio
async def test_wrong_shapes_are_refused_async(daemon: DaemonProcess) -> None:
    async with connect_async(daemon.socket) as client:
        ns = await client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(32), 16, ns.key_salt)
        with pytest.raises(InvalidRequestError, match="not a single bytes: pass"):
            await ns.put(keys[0], _blocks(1)[0])
        with pytest.raises(InvalidRequestError, match="got str at index 0"):
            await ns.lookup(["k"])
        with pytest.raises(InvalidRequestError, match="got str at index 0"):
            async with ns.lease(["k"]):
                pass
        assert await ns.lookup(keys) == 0


# -- identity and reprs ----------------------------------------------------------------------


def test_namespace_identity_and_reprs(daemon: DaemonProcess) -> None:
    with connect(daemon.socket, client_name="api-test") as client:
        assert repr(client) == (
            f"<Client {daemon.socket} connected, daemon {client.daemon_version}, reconnect off>"
        )
        ns = client.namespace("tp", layout=LAYOUT, rank=1, world_size=2)
        assert (ns.name, ns.tenant, ns.rank, ns.world_size) == ("tp", "default", 1, 2)
        assert (ns.block_bytes, ns.layout) == (LAYOUT_BYTES, LAYOUT)
        assert repr(ns) == (
            "<Namespace 'tp' tenant='default' block_bytes=368640 "
            "layout='HuggingFaceTB/SmolLM2-135M'/bfloat16 rank=1/2>"
        )
        plain = client.namespace("plain", block_bytes=BLOCK)
        assert repr(plain) == "<Namespace 'plain' tenant='default' block_bytes=4096>"
        keys = chain_keys(range(48), 16, plain.key_salt)
        plain.put(keys[:2], _blocks(2))
        lease = plain.acquire(keys[:2])
        assert repr(lease) == "<BlockLease of 2 blocks, held>"
        lease.release()
        assert repr(lease) == "<BlockLease of 2 blocks, released>"
        with plain.write(keys) as write:
            assert repr(write) == "<BlockWrite of 3 blocks, 1 to fill>"
            write.views[2][:] = _blocks(1)[0].tobytes()
    assert repr(client).startswith(f"<Client {daemon.socket} closed, ")


@pytest.mark.anyio
async def test_async_reprs(daemon: DaemonProcess) -> None:
    async with connect_async(daemon.socket) as client:
        assert repr(client).startswith(f"<AsyncClient {daemon.socket} connected, daemon ")
        ns = await client.namespace("a", block_bytes=BLOCK, tenant="default")
        assert repr(ns) == "<AsyncNamespace 'a' tenant='default' block_bytes=4096>"
        assert ns.name == "a"
        keys = chain_keys(range(16), 16, ns.key_salt)
        await ns.put(keys, _blocks(1))
        async with ns.lease(keys) as lease:
            assert repr(lease) == "<BlockLease of 1 blocks, held>"
        assert repr(lease) == "<BlockLease of 1 blocks, released>"
    assert "closed" in repr(client)


# -- a closed client -------------------------------------------------------------------------


CLOSED = "ClosedError: the client is closed"


def _raised(call: Callable[[], Any]) -> str:
    """What ``call()`` raised, as ``"Class: message"`` (``"nothing"`` if it returned)."""
    try:
        call()
    except Exception as exc:  # the caller compares what each call raised
        return f"{type(exc).__name__}: {exc}"
    return "nothing"


async def _raised_async(call: Callable[[], Any]) -> str:
    try:
        await call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "nothing"


def _sync_calls(client: Any, ns: Namespace, keys: list[bytes]) -> dict[str, Callable[[], Any]]:
    return {
        "namespace": lambda: client.namespace("t", block_bytes=BLOCK),
        "stats": client.stats,
        "namespaces": client.namespaces,
        "fsync": client.fsync,
        "doctor": client.doctor,
        "pool_status": client.pool_status,
        "evict": client.evict,
        "region": lambda: client.region(ns.handle.region),
        "put": lambda: ns.put(keys, _blocks(len(keys))),
        "lookup": lambda: ns.lookup(keys),
        "lookup_tiers": lambda: ns.lookup_tiers(keys),
        "lookup_each": lambda: ns.lookup_each(keys),
        "present": lambda: ns.present(keys),
        "get": lambda: ns.get(keys).__enter__(),
        "acquire": lambda: ns.acquire(keys),
        "write": lambda: ns.write(keys).__enter__(),
        "read_into": lambda: ns.read_into(keys, [bytearray(BLOCK) for _ in keys]),
        "forget": lambda: ns.forget(keys),
        "hint": lambda: ns.hint([keys]),
        "arena": lambda: ns.arena,
        "arena_buffer": ns.arena_buffer,
    }


def test_every_call_on_a_closed_client_raises_closed_error(daemon: DaemonProcess) -> None:
    client = connect(daemon.socket)
    ns = client.namespace("t", block_bytes=BLOCK)
    keys = chain_keys(range(32), 16, ns.key_salt)
    ns.put(keys, _blocks(2))
    arena = ns.arena
    lease = ns.acquire(keys)
    view = lease.views[0]
    client.close()
    client.close()  # idempotent
    calls = _sync_calls(client, ns, keys)
    assert {name: _raised(call) for name, call in calls.items()} == dict.fromkeys(calls, CLOSED)
    # What was handed out before the close stops working rather than show reused bytes.
    with pytest.raises(ClosedError):
        lease.views  # noqa: B018
    with pytest.raises(ValueError, match="released"):
        bytes(view)
    with pytest.raises(ClosedError):
        arena.view(0, BLOCK)
    with pytest.raises(ClosedError):
        arena.buffer()
    lease.release()  # a no-op now, and no error
    assert not client.connected()


@pytest.mark.anyio
async def test_every_call_on_a_closed_async_client_raises_closed_error(
    daemon: DaemonProcess,
) -> None:
    async with connect_async(daemon.socket) as client:
        ns: AsyncNamespace = await client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(32), 16, ns.key_salt)
        await ns.put(keys, _blocks(2))
        arena = ns.arena
        async with contextlib.AsyncExitStack() as stack:
            lease = await stack.enter_async_context(ns.lease(keys))
            view = lease.views[0]
            await client.aclose()
        calls: dict[str, Callable[[], Any]] = {
            "namespace": lambda: client.namespace("t", block_bytes=BLOCK),
            "stats": client.stats,
            "namespaces": client.namespaces,
            "fsync": client.fsync,
            "evict": client.evict,
            "put": lambda: ns.put(keys, _blocks(2)),
            "lookup": lambda: ns.lookup(keys),
            "lookup_tiers": lambda: ns.lookup_tiers(keys),
            "lookup_each": lambda: ns.lookup_each(keys),
            "present": lambda: ns.present(keys),
            "read_into": lambda: ns.read_into(keys, [bytearray(BLOCK) for _ in keys]),
            "forget": lambda: ns.forget(keys),
            "hint": lambda: ns.hint([keys]),
        }
        raised = {name: await _raised_async(call) for name, call in calls.items()}
        assert raised == dict.fromkeys(calls, CLOSED)
        for manager in (ns.get(keys), ns.lease(keys), ns.write(keys)):
            with pytest.raises(ClosedError):
                async with manager:
                    pass
        with pytest.raises(ClosedError):
            ns.arena  # noqa: B018
        with pytest.raises(ClosedError):
            lease.views  # noqa: B018
        with pytest.raises(ValueError, match="released"):
            bytes(view)
        with pytest.raises(ClosedError):
            arena.view(0, BLOCK)


# -- socket paths ----------------------------------------------------------------------------


def _expected_errors(tmp_path: Path) -> list[tuple[Path, type[Exception], str]]:
    long = tmp_path / ("s" * (120 - len(str(tmp_path)) - 1))
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as sock:  # bound, never listening: nobody is there
        sock.bind(str(stale))
    regular = tmp_path / "regular"
    regular.write_text("not a socket\n")
    return [
        (long, InvalidRequestError, "socket path is 120 bytes; a Unix socket path is at most 107"),
        (tmp_path, DaemonNotRunningError, f"{tmp_path} is a directory, not the daemon's socket"),
        (
            regular,
            DaemonNotRunningError,
            f"{regular} is not a socket (kvtierd listens on a socket)",
        ),
        (tmp_path / "none.sock", DaemonNotRunningError, "kvtierd is not running (no daemon on "),
        (stale, DaemonNotRunningError, f"kvtierd is not running (no daemon on {stale})"),
    ]


def test_connect_says_what_is_wrong_with_the_socket_path(tmp_path: Path) -> None:
    for path, error, message in _expected_errors(tmp_path):
        with pytest.raises(error) as raised:
            connect(path)
        assert str(raised.value).startswith(message), (path, raised.value)


@pytest.mark.anyio
async def test_connect_async_says_what_is_wrong_with_the_socket_path(tmp_path: Path) -> None:
    for path, error, message in _expected_errors(tmp_path):
        with pytest.raises(error) as raised:
            async with connect_async(path):
                pass
        assert str(raised.value).startswith(message), (path, raised.value)
