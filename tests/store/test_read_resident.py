"""READ_RESIDENT in the store, and how READs reach the reuse model: each request is counted
once, however its READs are cut and whatever other requests share its blocks, and promotions
are no references."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from kvtierd.errors import BlockNotFoundError
from kvtierd.slsap import SlsapPolicy
from kvtierd.store.index import Owner
from kvtierd.store.namespaces import Namespace
from kvtierd.store.store import BlockStore
from tests.store.test_store_pressure import key_of, put, small_store

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


async def on_nvme_only(store: BlockStore, ns: Namespace, count: int) -> list[bytes]:
    """``count`` blocks written, made durable and evicted from DRAM; the policy's events so far
    delivered."""
    owner = Owner()
    keys = [key_of(i) for i in range(count)]
    for key in keys:
        await put(store, owner, ns, key)
    await store.fsync()
    await store.evict_dram(ns)
    store.dram_policy_of(ns).flush()
    return keys


def references(store: BlockStore) -> int:
    """The references the DRAM tier's reuse model has observed (its events delivered first)."""
    (tier_policy,) = store.dram_policies.values()  # one region
    tier_policy.flush()
    policy = tier_policy.policy
    assert isinstance(policy, SlsapPolicy)
    return policy.statistics().references


async def test_lookup_read_resident_then_read_is_one_request(tmp_path: Path) -> None:
    async with small_store(tmp_path, 1 << 20) as (store, ns):
        owner = Owner()
        keys = await on_nvme_only(store, ns, 6)
        held = await store.read(owner, ns, keys[:3])  # the first three back in DRAM
        store.release(owner, [held.id])
        hits, _ = store.lookup(ns, keys, promote=False)
        assert hits == 6
        observed = references(store)
        lease = await store.lease_resident(owner, ns, keys)
        assert lease is not None
        assert [b.key for b in lease.blocks] == keys[:3]
        rest = await store.read(owner, ns, keys[3:])
        # one LOOKUP, one request: neither the partial lease nor the READ of the rest was
        # observed as a request of its own
        assert references(store) == observed
        store.release(owner, [lease.id, rest.id])
        with pytest.raises(BlockNotFoundError, match="not in DRAM"):
            await store.lease_resident(owner, ns, [b"not-stored" + bytes(6)])
        many = [b"not-stored" + i.to_bytes(6, "big") for i in range(store.lane.inline_items + 1)]
        with pytest.raises(BlockNotFoundError, match="not in DRAM"):  # walked in slices
            await store.lease_resident(owner, ns, many)


async def test_a_lookup_promotion_is_not_a_second_reference(tmp_path: Path) -> None:
    async with small_store(tmp_path, 1 << 20) as (store, ns):
        keys = await on_nvme_only(store, ns, 4)
        before = references(store)
        store.lookup(ns, keys)  # observes the chain, promotes its four blocks
        owner = Owner()
        lease = await store.read(owner, ns, keys)  # waits for those promotions
        assert all(block.dram is not None for block in lease.blocks)
        # one reference per block for the LOOKUP, none for the promotions it started nor for
        # the READ of its chain
        assert references(store) - before == len(keys)
        store.release(owner, [lease.id])


async def test_a_read_with_no_lookup_counts_every_time(tmp_path: Path) -> None:
    async with small_store(tmp_path, 1 << 20) as (store, ns):
        owner = Owner()
        keys = await on_nvme_only(store, ns, 4)
        for _ in range(3):
            before = references(store)
            lease = await store.read(owner, ns, keys)
            store.release(owner, [lease.id])
            assert references(store) - before == len(keys)


async def test_requests_sharing_a_prefix_and_reads_in_batches_count_once(tmp_path: Path) -> None:
    async with small_store(tmp_path, 1 << 20) as (store, ns):
        owner = Owner()
        keys = await on_nvme_only(store, ns, 8)
        a, b = keys[:6], [*keys[:2], *keys[6:]]  # a system prompt both start with
        before = references(store)
        store.lookup(ns, a)
        store.lookup(ns, b)
        assert references(store) - before == len(a) + len(b)
        observed = references(store)
        leases = [await store.read(owner, ns, a[:3]), await store.read(owner, ns, a[3:])]
        leases.append(await store.read(owner, ns, b))
        assert references(store) == observed  # both requests' READs were already counted
        store.release(owner, [lease.id for lease in leases])
        again = await store.read(owner, ns, a[:2])  # no LOOKUP named these since: new
        assert references(store) - observed == 2
        store.release(owner, [again.id])


async def test_hinted_promotions_are_not_references(tmp_path: Path) -> None:
    async with small_store(tmp_path, 1 << 20) as (store, ns):
        owner = Owner()
        keys = await on_nvme_only(store, ns, 4)
        before = references(store)
        assert store.prefetch(await store.prefetcher.plan_queue(ns, [keys])) == len(keys)
        lease = await store.read(owner, ns, keys)  # waits for the promotions
        assert references(store) - before == len(keys)  # the queued request, once
        store.release(owner, [lease.id])


async def test_a_large_lookup_waits_its_turn_on_the_lane_and_a_small_one_does_not(
    tmp_path: Path,
) -> None:
    """A LOOKUP of more keys than the lane's ``inline_items`` runs only when the bulk work
    before it gave the lane up (issue 31: one such LOOKUP is a step of a few ms); a small one
    is answered at once, whoever holds the lane."""
    async with small_store(tmp_path, 4096) as (store, ns):
        keys = [key_of(i) for i in range(store.lane.inline_items + 1)]
        for key in keys[:3]:
            await put(store, Owner(), ns, key)
        answers: list[int] = []

        async def large() -> None:
            hits, _ = await store.lookup_in_turn(ns, keys, promote=False)
            answers.append(hits)

        async with store.lane.walk(len(keys)) as bulk, anyio.create_task_group() as tg:
            await bulk.pause()  # another request's bulk work holds the lane
            tg.start_soon(large)
            await anyio.sleep(0.05)
            assert answers == []
            small, _ = await store.lookup_in_turn(ns, keys[:2], promote=False)
            assert small == 2
            bulk.release()
        assert answers == [3]
