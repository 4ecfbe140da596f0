"""kvtierd as SGLang's L3 storage for hybrid models: ``batch_exists_v2``, ``batch_get_v2`` and
``batch_set_v2`` against a real daemon, on SGLang 0.5.23's real ``PoolTransfer``,
``PoolHitPolicy`` and ``PoolTransferResult``, its real ``MambaPoolHost`` (whose own page copy
moves the states) and, as the reference for every answer, SGLang's own file backend
(``HiCacheFile``) given the same calls.

The KV, sliding-window and indexer pools are :class:`~tests.engines.test_sglang.HostPool`
(SGLang's MHA host-pool page methods, copied: the real class cannot be imported here).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtierd.testing import DaemonProcess

torch = pytest.importorskip("torch")
pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="SGLang's storage layer is not installed (tools/setup.sh test installs it)",
)
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    count_pool_hits,
)

from kvtierd.errors import InvalidRequestError  # noqa: E402
from tests.engines.test_sglang import PAGE, HostPool, backend, config, hashes  # noqa: E402
from tests.support.sglang_pools import mamba_pool_host  # noqa: E402

pytestmark = pytest.mark.timeout(180)

ALL, TRAILING = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES
PAGES = 16  # pages in each host pool
SWA_WINDOW = 2  # pages a sliding window needs before the prefix's end
MAMBA_WINDOW = 1


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvtierd", dram_size="64M", nvme_size="256M") as process:
        yield process


class Pools:
    """A hybrid model's host pools: KV (the anchor), the DSA indexer's, a sliding window's and
    SGLang's real Mamba state pool."""

    def __init__(self, seed: int | None = None) -> None:
        self.kv = HostPool(PAGES)
        self.indexer = HostPool(PAGES)
        self.swa = HostPool(PAGES)
        self.mamba = mamba_pool_host(PAGES)
        if seed is not None:
            for i, pool in enumerate((self.kv, self.indexer, self.swa)):
                pool.fill(seed + i)
            g = torch.Generator().manual_seed(seed)
            for buffer in (self.mamba.temporal_buffer, *self.mamba.conv_buffer):
                buffer.copy_(torch.randn(buffer.shape, generator=g))

    def attach(self, store: Any) -> Any:
        """Register the pools as SGLang's hybrid controller does: the anchor, then each
        entry of its host pool group by name."""
        store.register_mem_pool_host(self.kv)
        for name, pool in self.named().items():
            store.register_mem_host_pool_v2(pool, name)
        store.on_host_pools_registered()
        return store

    def named(self) -> dict[PoolName, Any]:
        return {
            PoolName.KV: self.kv,
            PoolName.INDEXER: self.indexer,
            PoolName.SWA: self.swa,
            PoolName.MAMBA: self.mamba,
        }

    def page(self, name: PoolName, index: int) -> Any:
        return self.named()[name].get_data_page(index, flat=True).view(torch.uint8).clone()


def tokens(pages: list[int]) -> Any:
    """The host indices of ``pages`` of a KV-like pool (``PAGE`` tokens each)."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def transfer(name: PoolName, keys: list[str], pages: list[int], policy: Any = ALL) -> Any:
    step = 1 if name == PoolName.MAMBA else PAGE  # a Mamba "page" is one state slot
    indices = torch.tensor(pages) if step == 1 else tokens(pages)
    assert indices.numel() == len(keys) * step
    return PoolTransfer(name=name, keys=keys, host_indices=indices, hit_policy=policy)


def query(keys: list[str], swa: int = SWA_WINDOW, mamba: int = MAMBA_WINDOW) -> list[Any]:
    """The pool transfers of a ``batch_exists_v2``: for a trailing pool, ``keys`` carries
    its window (SGLang passes the window's keys; only their count is read)."""
    return [
        PoolTransfer(name=PoolName.INDEXER, keys=list(keys), hit_policy=ALL),
        PoolTransfer(name=PoolName.SWA, keys=keys[-swa:], hit_policy=TRAILING),
        PoolTransfer(name=PoolName.MAMBA, keys=keys[-mamba:], hit_policy=TRAILING),
    ]


def back_up(store: Any, keys: list[str], end: int, extra_info: Any = None) -> dict[str, list[bool]]:
    """Back up span ``keys[:end]`` (host pages ``0..end-1``) in one ``batch_set_v2``: the KV
    and indexer pages of every page, and the trailing pools' pages at the span's end (the KV
    pages go where ``batch_set_v1`` puts them)."""
    swa = list(range(end - SWA_WINDOW, end))
    return store.batch_set_v2(
        [
            transfer(PoolName.KV, keys[:end], list(range(end))),
            transfer(PoolName.INDEXER, keys[:end], list(range(end))),
            transfer(PoolName.SWA, [keys[p] for p in swa], swa, TRAILING),
            transfer(PoolName.MAMBA, [keys[end - 1]], [end - 1], TRAILING),
        ],
        extra_info,
    )


def same_result(a: PoolTransferResult, b: PoolTransferResult) -> bool:
    def plain(r: PoolTransferResult) -> tuple[Any, ...]:
        hits = {str(k): v for k, v in r.extra_pool_hit_pages.items()}
        return r.kv_hit_pages, hits, list(r.restorable_prefix_pages or [])

    return plain(a) == plain(b)


def file_backend(tmp: Path) -> Any:
    cfg = config()
    cfg.extra_config = {"file_storage_path": str(tmp)}
    return HiCacheFile(cfg, file_path=str(tmp))


# -- byte-exact, all or nothing --------------------------------------------------------------


def test_every_pool_comes_back_byte_exact_after_a_daemon_restart(daemon: DaemonProcess) -> None:
    pools = Pools(seed=1)
    store = pools.attach(backend(daemon.socket))
    keys = hashes(8)
    written = back_up(store, keys, 8)
    assert count_pool_hits(written) == {
        PoolName.KV: 8,
        PoolName.INDEXER: 8,
        PoolName.SWA: 2,
        PoolName.MAMBA: 1,
    }
    store.close()
    daemon.stop()
    daemon.start()

    fresh = Pools()
    store = fresh.attach(backend(daemon.socket))
    result = store.batch_exists_v2(keys, query(keys), HiCacheStorageExtraInfo())
    assert isinstance(result, PoolTransferResult)
    assert result.kv_hit_pages == 8
    assert result.restorable_prefix_pages == [8]  # the windows end at the span's end only
    assert dict(result.extra_pool_hit_pages) == {
        PoolName.KV: 8,
        PoolName.INDEXER: 8,
        PoolName.SWA: 8,
        PoolName.MAMBA: 8,
    }
    # restored into other host pages than they were stored from
    at = [p + 8 for p in range(8)]
    assert store.batch_get_v1(keys, tokens(at)) == [True] * 8
    got = store.batch_get_v2(
        [
            transfer(PoolName.INDEXER, keys, at),
            transfer(PoolName.SWA, keys[6:], at[6:], TRAILING),
            transfer(PoolName.MAMBA, keys[7:], [5], TRAILING),
        ]
    )
    assert count_pool_hits(got) == {PoolName.INDEXER: 8, PoolName.SWA: 2, PoolName.MAMBA: 1}
    for p in range(8):
        assert torch.equal(fresh.page(PoolName.KV, at[p] * PAGE), pools.page(PoolName.KV, p * PAGE))
        assert torch.equal(
            fresh.page(PoolName.INDEXER, at[p] * PAGE), pools.page(PoolName.INDEXER, p * PAGE)
        )
    for p in (6, 7):
        assert torch.equal(
            fresh.page(PoolName.SWA, at[p] * PAGE), pools.page(PoolName.SWA, p * PAGE)
        )
    assert torch.equal(fresh.page(PoolName.MAMBA, 5), pools.page(PoolName.MAMBA, 7))
    assert torch.equal(fresh.mamba.temporal_buffer[5], pools.mamba.temporal_buffer[7])
    store.close()


def test_a_pool_that_lacks_its_pages_shrinks_the_prefix_to_what_every_pool_has(
    daemon: DaemonProcess,
) -> None:
    pools = Pools(seed=2)
    store = pools.attach(backend(daemon.socket))
    keys = hashes(8)
    back_up(store, keys, 4)  # a first span of 4 pages
    assert all(store.batch_set_v1(keys, tokens(list(range(8)))))  # then KV pages alone
    result = store.batch_exists_v2(keys, query(keys))
    # the KV pages reach 8, the indexer 4, and the trailing pools only the first span's end
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (4, [4])
    assert result.extra_pool_hit_pages[PoolName.KV] == 8
    assert result.extra_pool_hit_pages[PoolName.INDEXER] == 4
    # a Mamba state missing: nothing is restorable, whatever the other pools hold
    other = hashes(4)
    assert all(store.batch_set_v1(other, tokens([0, 1, 2, 3])))
    none = store.batch_exists_v2(other, query(other))
    assert (none.kv_hit_pages, none.restorable_prefix_pages) == (0, [])
    # a miss in the anchor: the pools are not asked
    assert store.batch_exists_v2(hashes(3), query(hashes(3))).extra_pool_hit_pages == {}
    store.close()


def test_answers_equal_sglangs_own_file_backend_given_the_same_calls(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Random spans backed up in random order, then every prefix query, on kvtierd and on
    ``HiCacheFile``: the same ``PoolTransferResult`` every time."""
    rng = random.Random(7)
    pools = Pools(seed=3)
    ours = pools.attach(backend(daemon.socket))
    theirs = pools.attach(file_backend(tmp_path / "hicache"))
    for _ in range(4):
        keys = hashes(12)
        ends = sorted(rng.sample(range(SWA_WINDOW, 13), 3))
        for end in ends if rng.random() < 0.5 else ends[::-1]:
            for store in (ours, theirs):
                written = back_up(store, keys, end)
                assert count_pool_hits(written)[PoolName.INDEXER] == end
        for length in range(1, 13):
            for swa, mamba in ((SWA_WINDOW, MAMBA_WINDOW), (1, 3)):
                asked = keys[:length]
                a = ours.batch_exists_v2(asked, query(asked, swa, mamba))
                b = theirs.batch_exists_v2(asked, query(asked, swa, mamba))
                assert same_result(a, b), (ends, length, swa, mamba, a, b)
    ours.close()


def test_tenants_of_one_server_never_read_each_others_pool_pages(daemon: DaemonProcess) -> None:
    pools = Pools(seed=4)
    store = pools.attach(backend(daemon.socket))
    keys = hashes(4)
    alice = HiCacheStorageExtraInfo(extra_info={"cache_salt": "alice"})
    bob = HiCacheStorageExtraInfo(extra_info={"cache_salt": "bob"})
    back_up(store, keys, 4, alice)
    assert store.batch_exists_v2(keys, query(keys), alice).kv_hit_pages == 4
    assert store.batch_exists_v2(keys, query(keys), bob).kv_hit_pages == 0
    got = store.batch_get_v2([transfer(PoolName.MAMBA, keys[3:], [9], TRAILING)], bob)
    assert got == {PoolName.MAMBA: [False]}
    store.close()


# -- refusals --------------------------------------------------------------------------------


def test_a_pool_that_cannot_be_served_is_refused_at_attach(daemon: DaemonProcess) -> None:
    store = backend(daemon.socket)
    with pytest.raises(ValueError, match="does not serve the pool 'deepseek_v4_c4'"):
        store.register_mem_host_pool_v2(HostPool(2), PoolName.DEEPSEEK_V4_C4)
    with pytest.raises(ValueError, match="lacks get_data_page, get_dummy_flat_data_page"):
        store.register_mem_host_pool_v2(object(), PoolName.MAMBA)
    store.close()


def test_calls_sglang_could_not_mean_raise_before_anything_is_sent(
    daemon: DaemonProcess,
) -> None:
    pools = Pools(seed=5)
    store = pools.attach(backend(daemon.socket))
    keys = hashes(2)
    with pytest.raises(ValueError, match="not 'block_groups'"):
        store.batch_exists_v2(
            keys, [PoolTransfer(name=PoolName.INDEXER, keys=keys, hit_policy="block_groups")]
        )
    with pytest.raises(InvalidRequestError, match="'draft' was not registered"):
        store.batch_get_v2([transfer(PoolName.DRAFT, keys, [0, 1])])
    short = PoolTransfer(name=PoolName.SWA, keys=keys, host_indices=tokens([0]))
    with pytest.raises(InvalidRequestError, match="need 32 host indices, not 16"):
        store.batch_set_v2([short])
    assert store.statistics().pages_written == 0
    store.close()


def test_a_daemon_that_is_gone_is_a_miss_never_an_exception(daemon: DaemonProcess) -> None:
    pools = Pools(seed=6)
    store = pools.attach(backend(daemon.socket))
    keys = hashes(4)
    back_up(store, keys, 4)
    daemon.stop()
    assert store.batch_exists_v2(keys, query(keys)).kv_hit_pages == 0
    assert store.batch_get_v2([transfer(PoolName.MAMBA, keys[3:], [3], TRAILING)]) == {
        PoolName.MAMBA: [False]
    }
    assert store.batch_set_v2([transfer(PoolName.INDEXER, keys, [0, 1, 2, 3])]) == {
        PoolName.INDEXER: [False] * 4
    }
    daemon.start()
    assert store.batch_exists_v2(keys, query(keys)).kv_hit_pages == 4
    store.close()
