"""READ_RESIDENT in the store: it leases only the leading DRAM blocks, and the READ of the rest
of the chain that follows is part of the same request for the reuse model, not a second one."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from kvtierd.slsap import SlsapPolicy
from kvtierd.store.index import Owner
from tests.store.test_store_pressure import key_of, put, small_store

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


async def test_lookup_read_resident_then_read_is_one_request(tmp_path: Path) -> None:
    async with small_store(tmp_path, 1 << 20) as (store, ns):
        owner = Owner()
        keys = [key_of(i) for i in range(6)]
        for key in keys:
            await put(store, owner, ns, key)
        await store.fsync()
        store.evict_dram(ns)
        held = await store.read(owner, ns, keys[:3])  # the first three back in DRAM
        store.release(owner, [held.id])
        policy = store.dram_policy.policy
        assert isinstance(policy, SlsapPolicy)
        hits, _ = store.lookup(ns, keys, promote=False)
        assert hits == 6
        store.dram_policy.flush()
        observed = policy.statistics().references
        lease = store.lease_resident(owner, ns, keys)
        assert lease is not None
        assert [b.key for b in lease.blocks] == keys[:3]
        rest = await store.read(owner, ns, keys[3:])
        store.dram_policy.flush()
        # one LOOKUP, one request: neither the partial lease nor the READ of the rest was
        # observed as a request of its own
        assert policy.statistics().references == observed
        store.release(owner, [lease.id, rest.id])
        assert store.lease_resident(owner, ns, [b"not-stored" + bytes(6)]) is None


async def test_a_lookup_promotion_is_not_a_second_reference(tmp_path: Path) -> None:
    async with small_store(tmp_path, 1 << 20) as (store, ns):
        owner = Owner()
        keys = [key_of(i) for i in range(4)]
        for key in keys:
            await put(store, owner, ns, key)
        await store.fsync()
        store.evict_dram(ns)
        policy = store.dram_policy.policy
        assert isinstance(policy, SlsapPolicy)
        store.dram_policy.flush()
        before = policy.statistics().references
        store.lookup(ns, keys)  # observes the chain, promotes its four blocks
        with anyio.fail_after(30):
            while any(b.dram is None for k in keys if (b := store.index.get(ns, k))):
                await anyio.sleep(0.01)
        store.dram_policy.flush()
        # one reference per block for the LOOKUP, none for the promotions it started
        assert policy.statistics().references - before == len(keys)
