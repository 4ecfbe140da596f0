"""Cancelled async calls and interrupted sync calls never leave leases behind."""

from __future__ import annotations

import random
import signal
import time

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from kvtierd.client import AsyncClient, TimedOutError, chain_keys, connect, connect_async
from kvtierd.testing import DaemonProcess

BLOCK = 64 << 10


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("keys_per_request", "resident_only"),
    [(None, False), (None, True), (3, False), (3, True)],
    ids=["read", "read-resident", "read-in-3", "read-resident-in-3"],
)
async def test_cancelled_gets_release_their_leases(
    daemon: DaemonProcess, keys_per_request: int | None, resident_only: bool
) -> None:
    """Cancelled at any moment, also between the requests of one lease that takes several
    (``keys_per_request``): every lease granted is given back."""
    rng = random.Random(5)
    async with connect_async(daemon.socket) as client:
        ns = await client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 8), 16, ns.key_salt)
        await ns.put(keys, [np.full(BLOCK, 3, np.uint8)] * 8)
        if keys_per_request is not None:
            client.max_keys = keys_per_request
        for _ in range(200):
            with anyio.move_on_after(rng.uniform(0, 0.002)):
                async with ns.lease(keys, resident_only=resident_only):
                    await anyio.lowlevel.checkpoint()
        await ns.lookup(keys)  # the janitor's releases are ahead of this on the connection
        for _ in range(100):
            if (await client.stats())["leases"] == 0:
                break
            await anyio.sleep(0.01)
        assert (await client.stats())["leases"] == 0


@pytest.mark.anyio
async def test_cancelled_puts_leave_no_write_pending(daemon: DaemonProcess) -> None:
    """A put of several ALLOC/COMMIT requests, cancelled at any moment: no write stays pending
    (what was allocated is committed or aborted), and what is stored is whole."""
    rng = random.Random(6)
    async with connect_async(daemon.socket) as client:
        ns = await client.namespace("t", block_bytes=BLOCK)
        client.max_keys = 3
        for round_ in range(60):
            keys = chain_keys(range(16 * (8 * round_), 16 * (8 * round_ + 8)), 16, ns.key_salt)
            with anyio.move_on_after(rng.uniform(0, 0.004)):
                await ns.put(keys, [np.full(BLOCK, round_, np.uint8)] * 8)
        # The aborts of cancelled ALLOCs go out in the background, behind whatever the daemon
        # is still doing for earlier requests (on a loaded disk that took over 1 s twice): give
        # them 10 s; a leaked write never clears. A STATS can be answered while an abandoned
        # ALLOC still waits for room (0, then 1 once it is granted, then 0 after its abort):
        # only a count taken with nothing of the client's in flight decides.
        for _ in range(1000):
            pending = (await client.stats())["pending_writes"]
            if pending == 0 and _quiet(client):
                break
            await anyio.sleep(0.01)
        assert _quiet(client)
        assert (await client.stats())["pending_writes"] == 0


def _quiet(client: AsyncClient) -> bool:
    """Nothing of ``client`` is in flight: no request awaits its reply (abandoned ones
    included), and its janitor has no abort or release queued or waiting to be sent. The
    janitor must be idle, waiting for its next item: one handed straight to it while it waited
    is in no buffer until it runs (and registers that request's waiter), and then a STATS
    answered before the daemon sees the abort still counts the write."""
    janitor = client._janitor_receive.statistics()
    return (
        not client._waiters
        and janitor.current_buffer_used == 0
        and janitor.tasks_waiting_receive == 1
        and client._send_lock.statistics().tasks_waiting == 0
    )


def test_a_timed_out_sync_call_drops_the_connection_and_its_leases(daemon: DaemonProcess) -> None:
    assert daemon.process is not None
    with connect(daemon.socket) as client:
        ns = client.namespace("t", block_bytes=BLOCK)
        keys = chain_keys(range(16 * 4), 16, ns.key_salt)
        ns.put(keys, [np.zeros(BLOCK, np.uint8)] * 4)
        client._sock.settimeout(0.3)
        daemon.process.send_signal(signal.SIGSTOP)  # the READ's reply will come too late
        try:
            with pytest.raises(TimedOutError):
                ns.get(keys).__enter__()
        finally:
            daemon.process.send_signal(signal.SIGCONT)
    with connect(daemon.socket) as observer:
        for _ in range(100):
            if observer.stats()["leases"] == 0:
                break
            time.sleep(0.01)
        assert observer.stats()["leases"] == 0
