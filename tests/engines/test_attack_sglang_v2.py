"""Attacks on the SGLang adapter's ``_v2`` calls (``register_mem_host_pool_v2``,
``batch_exists_v2``, ``batch_get_v2``, ``batch_set_v2``) as a buggy engine would make them,
against a real daemon: host pools that hand out pages of the wrong size or dtype, blocks
changed in the arena after COMMIT, every call from several threads at once, pool names that
stretch the namespace name, and the same ``cache_salt`` under two kvtierd tenants.

The rules (``kvtierd/engines/sglang.py``): SGLang's prefetch and backup threads die on an
exception from a backend, so a call answers a miss (``False``, 0) for whatever the daemon or
the data cannot serve; a pool that cannot be served is refused when SGLang attaches the
backend, in ``register_mem_host_pool_v2``, "not in its prefetch thread"; a block changed after
COMMIT is a miss and never reaches a host pool; one tenant never reads another's pages.

Found here: the 255-character check of a pool's namespace name happens only when a ``_v2``
call first opens that namespace, inside SGLang's prefetch or backup thread: the constructor
checks the KV name for ``layer_first``/``bfloat16`` only, and a pool's name is longer (its
``/pool-<name>`` part, its own layout and dtype), so a model name that passes the constructor
makes every ``batch_set_v2``/``batch_exists_v2``/``batch_get_v2`` of that pool raise
``ValueError`` (not a ``KvtierError``, so ``EngineLink.call`` lets it through).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
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
    HiCacheStorageExtraInfo,
    PoolName,
    count_pool_hits,
)

from kvtierd.client import connect  # noqa: E402
from kvtierd.engines.sglang_keys import identity_of, namespace_name, page_key  # noqa: E402
from tests.engines.test_sglang import PAGE, HostPool, backend, config, hashes  # noqa: E402
from tests.engines.test_sglang_v2 import (  # noqa: E402
    TRAILING,
    Pools,
    back_up,
    query,
    tokens,
    transfer,
)
from tests.support.attacks import unharmed  # noqa: E402
from tests.support.configs import config_text, tenant_table  # noqa: E402
from tests.support.scribble import scribble  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvtierd", dram_size="64M", nvme_size="256M") as process:
        yield process


class WrongPages(HostPool):
    """A host pool whose ``get_data_page`` hands out a page of another size: in another dtype
    (``float32``: twice the bytes), or cut short."""

    def __init__(self, pages_: int, how: str) -> None:
        super().__init__(pages_)
        self.how = how

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        page = super().get_data_page(index, flat)
        if self.how == "dtype":
            return page.to(torch.float32)
        return page[: page.numel() // 2]


def _pool_namespace(store: Any, name: str) -> Any:
    """The backend's own namespace of pool ``name`` (its session's)."""
    return store._link.call("test", lambda s: store._v2_namespace(s, store._pools[name]), None)


# -- a buggy host pool -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["dtype", "short"])
def test_a_page_of_the_wrong_size_is_refused_and_nothing_is_stored(
    daemon: DaemonProcess, how: str
) -> None:
    pools = Pools(seed=11)
    pools.swa = WrongPages(16, how)
    pools.swa.fill(99)
    store = pools.attach(backend(daemon.socket))
    keys = hashes(4)
    written = back_up(store, keys, 4)
    assert written[PoolName.SWA] == [False, False]  # refused, not raised
    assert written[PoolName.KV] == [True] * 4
    assert written[PoolName.INDEXER] == [True] * 4
    assert written[PoolName.MAMBA] == [True]
    ns = _pool_namespace(store, PoolName.SWA.value)
    assert ns.lookup([page_key(k) for k in keys]) == 0  # nothing of the pool was stored
    assert ns.client.stats()["pending_writes"] == 0
    result = store.batch_exists_v2(keys, query(keys))
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
    store.close()
    unharmed(daemon)


def test_a_pool_block_changed_after_commit_is_a_miss_and_never_reaches_the_pool(
    daemon: DaemonProcess,
) -> None:
    pools = Pools(seed=12)
    store = pools.attach(backend(daemon.socket))
    keys = hashes(8)
    back_up(store, keys, 8)
    swa = _pool_namespace(store, PoolName.SWA.value)
    mamba = _pool_namespace(store, PoolName.MAMBA.value)
    scribble(swa, [page_key(keys[7])])  # the second page of the window
    scribble(mamba, [page_key(keys[7])], at=3, count=64)

    fresh = Pools()
    reader = fresh.attach(backend(daemon.socket))
    got = reader.batch_get_v2(
        [
            transfer(PoolName.SWA, keys[6:], [10, 11], TRAILING),
            transfer(PoolName.MAMBA, keys[7:], [4], TRAILING),
        ]
    )
    assert got == {PoolName.SWA: [True, False], PoolName.MAMBA: [False]}
    assert torch.equal(fresh.page(PoolName.SWA, 10 * PAGE), pools.page(PoolName.SWA, 6 * PAGE))
    untouched = torch.zeros_like(fresh.page(PoolName.SWA, 11 * PAGE))
    assert torch.equal(fresh.page(PoolName.SWA, 11 * PAGE), untouched)  # nothing copied in
    assert not fresh.mamba.temporal_buffer[4].any()
    assert not any(conv[4].any() for conv in fresh.mamba.conv_buffer)
    # the other pools' blocks, and the unchanged pages, still serve
    result = reader.batch_exists_v2(keys, query(keys))
    assert result.kv_hit_pages == 8
    reader.close()
    store.close()
    unharmed(daemon)


# -- threads -----------------------------------------------------------------------------------


def test_every_v2_call_from_several_threads_at_once_moves_its_own_pages(
    daemon: DaemonProcess,
) -> None:
    """Four threads (SGLang's prefetch, backup and scheduler threads, and more) on one backend:
    each backs up its own chain from its own host pages, asks for it and loads it into other
    host pages, twenty times; a pool is registered meanwhile. Every page comes back as put."""
    pools = Pools(seed=13)
    store = pools.attach(backend(daemon.socket))
    errors: list[BaseException] = []
    start = threading.Barrier(5)

    def worker(t: int) -> None:
        try:
            start.wait()
            for _ in range(20):
                keys = hashes(2)
                src = [4 * t, 4 * t + 1]
                dst = [4 * t + 2, 4 * t + 3]
                written = store.batch_set_v2(
                    [
                        transfer(PoolName.KV, keys, src),
                        transfer(PoolName.INDEXER, keys, src),
                        transfer(PoolName.SWA, keys, src, TRAILING),
                        transfer(PoolName.MAMBA, keys[1:], src[1:], TRAILING),
                    ]
                )
                assert all(all(v) for v in written.values()), written
                result = store.batch_exists_v2(keys, query(keys))
                assert result.restorable_prefix_pages == [2], result
                got = store.batch_get_v2(
                    [
                        transfer(PoolName.KV, keys, dst),
                        transfer(PoolName.INDEXER, keys, dst),
                        transfer(PoolName.SWA, keys, dst, TRAILING),
                        transfer(PoolName.MAMBA, keys[1:], dst[1:], TRAILING),
                    ]
                )
                assert all(all(v) for v in got.values()), got
                for name in (PoolName.KV, PoolName.INDEXER, PoolName.SWA):
                    for s, d in zip(src, dst, strict=True):
                        assert torch.equal(pools.page(name, s * PAGE), pools.page(name, d * PAGE))
                assert torch.equal(
                    pools.page(PoolName.MAMBA, src[1]), pools.page(PoolName.MAMBA, dst[1])
                )
        except BaseException as exc:  # reported below, not lost in a thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    start.wait()
    store.register_mem_host_pool_v2(HostPool(4), PoolName.DRAFT)  # a sidecar, meanwhile
    for thread in threads:
        thread.join(120)
    assert errors == []
    assert store.statistics().errors == 0
    store.close()
    unharmed(daemon)


# -- names, tenants ----------------------------------------------------------------------------


def _longest_model(layout: str = "layer_first", dtype: str = "bfloat16") -> str:
    """The longest model name whose KV namespace name (``layout``, ``dtype``) fits: what the
    constructor accepts."""
    model = "org/" + "m" * 300
    while True:
        identity = identity_of(config(model_name=model))
        try:
            namespace_name(identity, layout=layout, dtype=dtype)
            return model
        except ValueError:
            model = model[:-1]


def test_a_pool_whose_namespace_name_is_too_long_is_refused_at_attach_not_in_sglangs_threads(
    daemon: DaemonProcess,
) -> None:
    """A model name the constructor accepts (its KV namespace name, as checked there, is 255
    characters): a pool's name is longer (``/pool-swa``). Either ``register_mem_host_pool_v2``
    refuses the pool with ``ValueError``, as it refuses the pools it cannot serve, or every
    ``_v2`` call answers a miss: none may raise in SGLang's prefetch or backup thread."""
    cfg = config(model_name=_longest_model())
    pools = Pools(seed=14)
    store = backend(daemon.socket, cfg)
    store.register_mem_pool_host(pools.kv)
    refused = []
    for name, pool in pools.named().items():
        try:
            store.register_mem_host_pool_v2(pool, name)
        except ValueError:
            refused.append(name)
    if PoolName.SWA in refused:
        store.close()
        return
    keys = hashes(4)
    assert store.batch_set_v1(keys, tokens([0, 1, 2, 3])) == [True] * 4  # the KV name fits
    answers: dict[str, Any] = {}
    calls: dict[str, Callable[[], Any]] = {
        "batch_set_v2": lambda: store.batch_set_v2(
            [transfer(PoolName.SWA, keys[2:], [2, 3], TRAILING)]
        ),
        "batch_exists_v2": lambda: store.batch_exists_v2(keys, query(keys)),
        "batch_get_v2": lambda: store.batch_get_v2(
            [transfer(PoolName.SWA, keys[2:], [2, 3], TRAILING)]
        ),
    }
    for what, call in calls.items():
        try:
            answers[what] = call()
        except ValueError as exc:
            answers[what] = exc
    store.close()
    raised = {what: str(a)[:80] for what, a in answers.items() if isinstance(a, Exception)}
    assert raised == {}, f"{refused=}: raised in SGLang's thread: {raised}"


TENANTS = config_text(
    tenant_table("alpha", uids=(2001,)), tenant_table("beta", uids=(2002,)), dram={"size": "64M"}
)


def test_one_cache_salt_under_two_kvtierd_tenants_never_meets(tmp_path: Path) -> None:
    """Two backends of one model, tenants alpha and beta (the daemon's root may name either),
    the same ``cache_salt`` and page hashes: beta finds and loads nothing of alpha's pools,
    and its own back-up of the same keys changes nothing alpha reads."""
    with DaemonProcess(tmp_path / "kvtierd", dram_size=None, config_text=TENANTS) as daemon:
        salt = HiCacheStorageExtraInfo(extra_info={"cache_salt": "shared"})
        alpha_pools, beta_pools = Pools(seed=15), Pools(seed=16)
        alpha = alpha_pools.attach(backend(daemon.socket, tenant="alpha"))
        beta = beta_pools.attach(backend(daemon.socket, tenant="beta"))
        keys = hashes(4)
        back_up(alpha, keys, 4, salt)
        before = beta_pools.mamba.temporal_buffer[9].clone()
        result = beta.batch_exists_v2(keys, query(keys), salt)
        assert (result.kv_hit_pages, result.restorable_prefix_pages) == (0, [])
        got = beta.batch_get_v2([transfer(PoolName.MAMBA, keys[3:], [9], TRAILING)], salt)
        assert got == {PoolName.MAMBA: [False]}
        assert torch.equal(beta_pools.mamba.temporal_buffer[9], before)  # nothing loaded
        back_up(beta, keys, 4, salt)  # the same keys, beta's bytes
        fresh = Pools()
        reader = fresh.attach(backend(daemon.socket, tenant="alpha"))
        got = reader.batch_get_v2([transfer(PoolName.INDEXER, keys, [8, 9, 10, 11])], salt)
        assert count_pool_hits(got) == {PoolName.INDEXER: 4}
        for p in range(4):
            assert torch.equal(
                fresh.page(PoolName.INDEXER, (8 + p) * PAGE),
                alpha_pools.page(PoolName.INDEXER, p * PAGE),
            )
        with connect(daemon.socket) as admin:
            names = {(n["name"], n["tenant"]) for n in admin.namespaces()}
        assert {t for _, t in names} >= {"alpha", "beta"}
        for store in (alpha, beta, reader):
            store.close()
        unharmed(daemon)


def test_a_host_pool_whose_kv_namespace_name_is_too_long_is_refused_at_attach(
    daemon: DaemonProcess,
) -> None:
    """The ``_v1`` path's namespace is named from the host pool's layout and dtype, which the
    constructor does not know: a longer layout and dtype than it checked push the name past
    kvtierd's bound, and ``register_mem_pool_host`` says so (not ``batch_exists`` later, in
    SGLang's prefetch thread)."""
    store = backend(daemon.socket, config(model_name=_longest_model()))
    pool = HostPool(2, layout="page_first_direct")
    pool.dtype = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="longer than 255 characters"):
        store.register_mem_pool_host(pool)
    assert store.batch_exists(hashes(2)) == 0  # nothing registered, nothing raised
    store.close()
