"""GroupMembership against a real redis-server: several ranks in one event loop, each with its own
client, as the ranks of one TP group on different hosts would be."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio
from redis.asyncio.cluster import RedisCluster

from kvtierd.errors import StorageIOError, TimedOutError
from kvtierd.pool.consensus import GroupKeys, decode_proposal, decode_vote
from kvtierd.pool.group import GroupMembership, GroupState, GroupStatus, RedisLike
from kvtierd.testing.redis_server import RedisCluster as RedisClusterServers
from kvtierd.testing.redis_server import RedisServer, require_redis_server

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.timeout(60)]

GROUP = "g"
VOTE_TIMEOUT_S = 1.0
WAIT_S = 20.0  # generous: an upper bound for a loaded machine, not a measurement


@pytest.fixture
def anyio_backend() -> str:
    # redis-py's asyncio client runs on asyncio only; the daemon refuses a pool under trio.
    return "asyncio"


def connector(server: RedisServer) -> Callable[[], Awaitable[RedisLike]]:
    async def connect() -> RedisLike:
        client = redis.asyncio.Redis(
            **server.connection_kwargs(), socket_timeout=2, socket_connect_timeout=1
        )
        try:
            await client.ping()
        except BaseException:
            await client.aclose()
            raise
        return client

    return connect


async def write_read_probe(client: RedisLike) -> None:
    await client.set("kvt:{g}:probe", b"x", px=10_000)
    if await client.get("kvt:{g}:probe") != b"x":
        raise StorageIOError("pool probe read back different bytes")


class Rank:
    """One running GroupMembership, with the history of its statuses; stop() cancels it."""

    def __init__(self) -> None:
        self.history: list[GroupStatus] = []
        self.changed = anyio.Event()
        self.scope = anyio.CancelScope()
        self.stopped = anyio.Event()
        self.membership: GroupMembership

    def observe(self, status: GroupStatus) -> None:
        self.history.append(status)
        self.changed.set()
        self.changed = anyio.Event()

    async def until(self, predicate: Callable[[list[GroupStatus]], bool]) -> GroupStatus:
        with anyio.fail_after(WAIT_S):
            while not predicate(self.history):
                await self.changed.wait()
        return self.status

    async def run(self) -> None:
        try:
            with self.scope:
                await self.membership.run()
        finally:
            self.stopped.set()

    async def stop(self) -> None:
        self.scope.cancel()
        await self.stopped.wait()

    @property
    def status(self) -> GroupStatus:
        return self.membership.status


class Group:
    def __init__(self, server: RedisServer, tg: anyio.abc.TaskGroup) -> None:
        self.server = server
        self.tg = tg

    def start(
        self,
        rank: int,
        world_size: int = 2,
        *,
        digest: str = "digest-one",
        probe: Callable[[RedisLike], Awaitable[None]] = write_read_probe,
    ) -> Rank:
        handle = Rank()
        handle.membership = GroupMembership(
            group_id=GROUP,
            rank=rank,
            world_size=world_size,
            address=self.server.url,
            digest=digest,
            connect=connector(self.server),
            probe=probe,
            vote_timeout_s=VOTE_TIMEOUT_S,
            heartbeat_s=0.2,
            backoff_s=(0.05, 0.5),
            on_change=handle.observe,
        )
        self.tg.start_soon(handle.run)
        return handle


@asynccontextmanager
async def group_on(server: RedisServer) -> AsyncIterator[Group]:
    async with anyio.create_task_group() as tg:
        yield Group(server, tg)
        tg.cancel_scope.cancel()


@asynccontextmanager
async def pool_client(server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis(**server.connection_kwargs())
    try:
        yield client
    finally:
        await client.aclose()


async def until(rank: Rank, predicate: Callable[[GroupStatus], bool]) -> GroupStatus:
    return await rank.until(lambda history: bool(history) and predicate(history[-1]))


async def attached(
    *ranks: Rank, where: Callable[[GroupStatus], bool] = lambda status: True
) -> list[GroupStatus]:
    """Wait until every rank is attached by a decision that satisfies ``where``."""
    return [await until(r, lambda s: s.state is GroupState.ATTACHED and where(s)) for r in ranks]


async def epoch_counter(server: RedisServer) -> int:
    async with pool_client(server) as client:
        return int(await client.get(GroupKeys(GROUP).epoch) or 0)


def decided_local(status: GroupStatus) -> bool:
    return status.state is GroupState.LOCAL and status.epoch > 0


async def test_tp2_attaches(redis_server: RedisServer) -> None:
    async with group_on(redis_server) as group:
        leader, follower = group.start(0), group.start(1)
        first, second = await attached(leader, follower)
        assert (await leader.membership.wait_for(GroupState.ATTACHED, WAIT_S)).members == (0, 1)
        assert (first.epoch, first.nonce) == (second.epoch, second.nonce)
        assert first.members == second.members == (0, 1)
        assert first.refusals == second.refusals == {}
        assert first.reason == ""
        assert leader.membership.client is not None
        assert follower.membership.client is not None


async def test_different_digests_keep_both_ranks_local(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvtierd.pool")
    async with group_on(redis_server) as group:
        leader, follower = group.start(0, digest="3a" * 16), group.start(1, digest="9f" * 16)
        statuses = [await until(r, decided_local) for r in (leader, follower)]
    why = "pool config digest 9f9f9f9f9f9f.. differs from the leader's 3a3a3a3a3a3a.."
    for status in statuses:
        assert status.refusals == {1: why}
        assert status.members == (0,)
        assert f"rank 1 refused: {why}" in status.reason
    assert f"group g stays local (epoch {statuses[0].epoch}): rank 1 refused: {why}" in caplog.text
    assert all(r.state is not GroupState.ATTACHED for r in leader.history + follower.history)


async def test_missing_rank_keeps_group_local_until_it_comes(redis_server: RedisServer) -> None:
    async with group_on(redis_server) as group:
        ranks = [group.start(0, 3), group.start(1, 3)]
        statuses = [await until(r, decided_local) for r in ranks]
        for status in statuses:
            assert status.refusals == {2: f"did not vote within {VOTE_TIMEOUT_S:.1f} s"}
            assert f"rank 2 did not vote within {VOTE_TIMEOUT_S:.1f} s" in status.reason
        with pytest.raises(TimedOutError):
            await ranks[0].membership.wait_for(GroupState.ATTACHED, 0.01)
        ranks.append(group.start(2, 3))
        final = await attached(*ranks)
        assert {s.members for s in final} == {(0, 1, 2)}


async def test_failing_probe_keeps_group_local(redis_server: RedisServer) -> None:
    async def broken_probe(client: RedisLike) -> None:
        raise StorageIOError("pool probe read back different bytes than it wrote")

    async with group_on(redis_server) as group:
        ranks = group.start(0), group.start(1, probe=broken_probe)
        statuses = [await until(r, decided_local) for r in ranks]
    for status in statuses:
        assert status.refusals == {1: "pool probe read back different bytes than it wrote"}


async def test_world_size_mismatch_is_a_no(redis_server: RedisServer) -> None:
    async with group_on(redis_server) as group:
        ranks = group.start(0, 2), group.start(1, 3)
        statuses = [await until(r, decided_local) for r in ranks]
    assert statuses[0].refusals == {1: "world size 3 differs from the leader's 2"}


async def test_restarted_leader_reattaches_with_a_higher_epoch(redis_server: RedisServer) -> None:
    async with group_on(redis_server) as group:
        leader, follower = group.start(0), group.start(1)
        await attached(leader, follower)
        await leader.stop()
        assert leader.membership.client is None
        assert leader.status.state is GroupState.LOCAL
        mark = await epoch_counter(redis_server)
        leader = group.start(0)
        await attached(leader, follower, where=lambda s: s.epoch > mark)


async def test_stale_votes_never_count(redis_server: RedisServer) -> None:
    """The old round's yes of rank 1, copied by hand into the new round's ballot, is ignored."""
    keys = GroupKeys(GROUP)
    async with group_on(redis_server) as group, pool_client(redis_server) as spy:
        leader, follower = group.start(0), group.start(1)
        old, _ = await attached(leader, follower)
        old_proposal = decode_proposal(await spy.get(keys.proposal))
        stale = await spy.hget(keys.votes(old_proposal.round), "1")
        assert decode_vote(stale).yes
        await leader.stop()
        await follower.stop()

        async def probe_that_stuffs_the_ballot(client: RedisLike) -> None:
            current = decode_proposal(await client.get(keys.proposal))
            assert current.round != old_proposal.round
            await client.hset(keys.votes(current.round), "1", stale)
            await write_read_probe(client)

        leader = group.start(0, probe=probe_that_stuffs_the_ballot)
        refused = await until(leader, decided_local)
        assert refused.refusals == {1: f"did not vote within {VOTE_TIMEOUT_S:.1f} s"}
        assert refused.epoch > old.epoch
        follower = group.start(1)
        final = await attached(leader, follower)
        assert final[0].epoch > refused.epoch


async def test_restarted_follower_reattaches(redis_server: RedisServer) -> None:
    async with group_on(redis_server) as group:
        leader, follower = group.start(0), group.start(1)
        await attached(leader, follower)
        await follower.stop()
        mark, seen = await epoch_counter(redis_server), len(leader.history)
        follower = group.start(1)
        await attached(leader, follower, where=lambda s: s.epoch > mark)
        assert GroupState.VOTING in {s.state for s in leader.history[seen:]}


def reattached_after_pool_loss(history: list[GroupStatus]) -> bool:
    """The history went LOCAL because of the pool, and later ATTACHED, and is attached now."""
    lost = [i for i, s in enumerate(history) if s.state is GroupState.LOCAL and "pool" in s.reason]
    return (
        bool(history)
        and bool(lost)
        and history[-1].state is GroupState.ATTACHED
        and any(s.state is GroupState.ATTACHED for s in history[lost[0] :])
    )


async def restart_and_reattach(server: RedisServer, *ranks: Rank) -> list[GroupStatus]:
    """Restart the pool server: every rank goes local for the pool, then attaches again."""
    marks = [len(r.history) for r in ranks]
    await anyio.to_thread.run_sync(server.restart)  # the event loop keeps running meanwhile
    return [
        await rank.until(lambda history, mark=mark: reattached_after_pool_loss(history[mark:]))
        for rank, mark in zip(ranks, marks, strict=True)
    ]


async def test_pool_restart_reattaches_by_itself(redis_server: RedisServer) -> None:
    async with group_on(redis_server) as group:
        ranks = group.start(0), group.start(1)
        await attached(*ranks)
        mark = await epoch_counter(redis_server)
        after = await restart_and_reattach(redis_server, *ranks)
        assert after[0].epoch > mark  # the counter survived (persistence)


async def test_pool_that_lost_its_data_reattaches(tmp_path: Path) -> None:
    """Without persistence the epoch counter restarts; the nonce keeps rounds apart."""
    require_redis_server()
    keys = GroupKeys(GROUP)
    with RedisServer(tmp_path / "redis", persistence=False) as server:
        async with group_on(server) as group, pool_client(server) as spy:
            ranks = group.start(0), group.start(1)
            await attached(*ranks)
            await spy.incrby(keys.epoch, 1000)
            await ranks[1].stop()  # its restart makes the next round, at epoch 1000+
            ranks = ranks[0], group.start(1)
            await attached(*ranks, where=lambda s: s.epoch > 1000)
            after = await restart_and_reattach(server, *ranks)
            assert after[0].epoch < 1000  # the counter was lost; nonce tells the rounds apart
            assert await spy.get(keys.epoch) is not None


async def test_tp2_attaches_on_a_cluster(redis_cluster: RedisClusterServers) -> None:
    """The group's keys share one slot; the heartbeat asks the node that owns it."""

    async def connect() -> RedisLike:
        options = redis_cluster.nodes[0].connection_kwargs()
        host, port = options.pop("host"), options.pop("port")
        client = RedisCluster(host=host, port=port, socket_timeout=2, **options)
        try:
            await client.initialize()
        except BaseException:
            await client.aclose()
            raise
        return client

    async with anyio.create_task_group() as tg:
        ranks = []
        for rank in (0, 1):
            handle = Rank()
            handle.membership = GroupMembership(
                group_id=GROUP,
                rank=rank,
                world_size=2,
                address=redis_cluster.url,
                digest="d",
                connect=connect,
                probe=write_read_probe,
                vote_timeout_s=VOTE_TIMEOUT_S,
                heartbeat_s=0.2,
                on_change=handle.observe,
            )
            tg.start_soon(handle.run)
            ranks.append(handle)
        statuses = await attached(*ranks)
        assert {s.members for s in statuses} == {(0, 1)}
        tg.cancel_scope.cancel()


def test_constructor_refuses_impossible_settings() -> None:
    common: dict[str, Any] = {
        "address": "redis://h:1/0",
        "digest": "d",
        "connect": connector,
        "probe": write_read_probe,
    }
    with pytest.raises(ValueError, match="outside"):
        GroupMembership(group_id="g", rank=2, world_size=2, **common)
    with pytest.raises(ValueError, match="braces"):
        GroupMembership(group_id="a}b", rank=0, world_size=1, **common)
    with pytest.raises(ValueError, match="backoff"):
        GroupMembership(group_id="g", rank=0, world_size=1, backoff_s=(1, 0.5), **common)
