"""The daemon's garbage-collection policy (:mod:`kvtierd.server.collector`): what it holds is
frozen out of full collections, what died young is still collected, and the frozen objects are
collected in full at the thaw, on asyncio and trio."""

from __future__ import annotations

import gc
import weakref

import anyio
import pytest

from kvtierd.server.collector import serve_collector

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _cycle() -> weakref.ref[_Node]:
    return weakref.ref(_Node())


async def test_long_lived_objects_are_frozen_and_young_cycles_still_freed() -> None:
    kept = [_Node() for _ in range(100)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_collector, 0.01, 3600.0)
        await anyio.sleep(0.05)
        assert gc.get_freeze_count() >= len(kept)  # what the daemon held at start
        young = _cycle()  # made after the freeze, dead at once
        await anyio.sleep(0.05)  # a freeze collects the young generations first
        assert young() is None
        tg.cancel_scope.cancel()
    assert gc.get_freeze_count() == 0  # thawed when the policy stops


async def test_a_frozen_cycle_is_collected_at_the_thaw() -> None:
    freed = anyio.Event()
    async with anyio.create_task_group() as tg:
        holder = [_Node()]
        frozen = weakref.ref(holder[0], lambda _: freed.set())
        tg.start_soon(serve_collector, 0.01, 0.2)
        await anyio.sleep(0.05)
        holder.clear()  # garbage now, but frozen: no collection walks it
        gc.collect()
        assert frozen() is not None
        with anyio.fail_after(10):
            await freed.wait()  # the thaw's full collection
        tg.cancel_scope.cancel()
