"""The store's lane (kvtierd/store/slicing.py): large walks take turns, small ones never wait."""

from __future__ import annotations

import itertools
import time

import anyio
import pytest

from kvtierd.store.slicing import Lane

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_a_small_walk_runs_in_one_go_without_the_lane() -> None:
    lane = Lane(slice_s=0.0, inline_items=8)
    order: list[str] = []

    async def other() -> None:
        order.append("other")

    async with anyio.create_task_group() as tg:
        tg.start_soon(other)  # ready, but a small walk never yields to it
        assert await lane.map(list(range(8)), lambda i: order.append(f"step{i}") or i) == list(
            range(8)
        )
    assert order[:8] == [f"step{i}" for i in range(8)]
    assert lane.turns == 0


async def test_two_large_walks_take_turns_slice_by_slice() -> None:
    """With a slice shorter than one step, each step is a turn: the walks alternate, and a task
    that does not use the lane runs between their slices."""
    lane = Lane(slice_s=0.0005, inline_items=0)
    order: list[str] = []
    beats = 0
    done = anyio.Event()

    def step(name: str) -> None:
        _busy(0.001)
        order.append(name)

    async def walk(name: str) -> None:
        await lane.map(range(5), lambda _: step(name))

    async def heartbeat() -> None:
        nonlocal beats
        while not done.is_set():
            beats += 1
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        async with anyio.create_task_group() as walks:
            walks.start_soon(walk, "a")
            walks.start_soon(walk, "b")
        done.set()
    assert sorted(order) == ["a"] * 5 + ["b"] * 5
    switches = sum(x != y for x, y in itertools.pairwise(order))
    assert switches >= 8  # a b a b ...: neither walk ran two slices while the other waited
    assert lane.turns >= 8
    assert beats >= 8  # the loop served others between slices


async def test_a_cancelled_walk_gives_the_lane_back() -> None:
    lane = Lane(slice_s=0.0, inline_items=0)
    started = anyio.Event()

    async def stuck() -> None:
        async with lane.walk(10) as walk:
            await walk.pause()  # holds the lane
            started.set()
            await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stuck)
        await started.wait()
        tg.cancel_scope.cancel()
    with anyio.fail_after(5):  # the lane is free again: a new walk gets it
        assert await lane.map([1, 2, 3], lambda i: i * 2) == [2, 4, 6]


async def test_release_lets_another_walk_run_while_one_waits() -> None:
    """A walk that lets the lane go before waiting (on I/O, in the store) does not stall the
    others; its next pause takes the lane again."""
    lane = Lane(slice_s=1.0, inline_items=0)
    order: list[str] = []
    waiting = anyio.Event()
    resume = anyio.Event()

    async def waits_on_io() -> None:
        async with lane.walk(2) as walk:
            await walk.pause()
            order.append("io-1")
            walk.release()
            waiting.set()
            await resume.wait()
            await walk.pause()
            order.append("io-2")

    async with anyio.create_task_group() as tg:
        tg.start_soon(waits_on_io)
        await waiting.wait()
        with anyio.fail_after(5):
            await lane.map(range(2), lambda i: order.append(f"other-{i}"))
        resume.set()
    assert order == ["io-1", "other-0", "other-1", "io-2"]
