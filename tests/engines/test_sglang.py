"""kvtierd as SGLang HiCache's L3 storage, on SGLang's real ``HiCacheStorageConfig`` and
``StorageBackendFactory``, against a real daemon: the ABC's whole surface, the ``_v1`` calls on
a host pool, a daemon restart (byte-exact) and a wiped data directory (misses, not errors), two
TP ranks and two tenants that never meet, and keys that never collide (hypothesis).

SGLang's real host pools (``sglang.srt.mem_cache.memory_pool_host``) cannot be imported on this
CPU-only machine (they pull in ``sgl_kernel`` and ``torchvision``), so :class:`HostPool` below is
SGLang's ``MHATokenToKVPoolHost`` page methods (``get_data_page``, ``set_from_flat_data_page``,
``get_dummy_flat_data_page``) over the same buffer shapes, copied from SGLang 0.5.23.
The tests of SGLang's mooncake backend (``storage/mooncake_store/test_mooncake_store.py``:
single set/get/exists, batch set/exists/get, zero-copy) are ported as the ``test_ported_*``.
"""

from __future__ import annotations

import shutil
import uuid
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
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvtierd.engines.sglang import KvtierdHiCacheStorage  # noqa: E402
from kvtierd.engines.sglang_keys import identity_of, namespace_name, page_key  # noqa: E402
from tests.support.scribble import scribble  # noqa: E402

pytestmark = pytest.mark.timeout(120)

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 64, 16  # 32 KiB pages in bfloat16
DTYPE = torch.bfloat16


def config(tmp: Path | None = None, **overrides: Any) -> HiCacheStorageConfig:
    fields: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": True,
        "model_name": "test/tiny-llama",
    }
    fields.update(overrides)
    return HiCacheStorageConfig(**fields)


def backend(socket: Path, cfg: HiCacheStorageConfig | None = None, **extra: Any) -> Any:
    cfg = cfg or config()
    cfg.extra_config = {"socket": str(socket), **extra}
    return KvtierdHiCacheStorage(cfg, {})


def pages(n: int, seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, PAGE, LAYERS, HEADS, HEAD_DIM)
    return [torch.randn(shape, generator=g).to(DTYPE).flatten() for _ in range(n)]


def empty_pages(n: int) -> list[Any]:
    return [torch.zeros(2 * PAGE * LAYERS * HEADS * HEAD_DIM, dtype=DTYPE) for _ in range(n)]


def same(a: Any, b: Any) -> bool:
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def hashes(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]


class HostPool:
    """SGLang 0.5.23's ``MHATokenToKVPoolHost`` page methods over its buffer shapes."""

    def __init__(self, pages_: int, layout: str = "page_first") -> None:
        self.page_size, self.layout, self.dtype = PAGE, layout, DTYPE
        self.layer_num, self.head_num, self.head_dim = LAYERS, HEADS, HEAD_DIM
        self.size = pages_ * PAGE
        if layout == "page_first":
            dims = (2, self.size, LAYERS, HEADS, HEAD_DIM)
        else:
            dims = (2, LAYERS, self.size, HEADS, HEAD_DIM)
        self.kv_buffer = torch.zeros(dims, dtype=DTYPE)

    def get_data_page(self, index: int, flat: bool = True) -> Any:
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        else:
            page = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> Any:
        shape = (2, self.layer_num, self.page_size, self.head_num, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        if self.layout == "layer_first":
            shape: tuple[int, ...] = (2, LAYERS, PAGE, HEADS, HEAD_DIM)
            self.kv_buffer[:, :, index : index + PAGE] = data_page.reshape(shape)
        else:
            shape = (2, PAGE, LAYERS, HEADS, HEAD_DIM)
            self.kv_buffer[:, index : index + PAGE] = data_page.reshape(shape)

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g).to(DTYPE))


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "kvtierd", dram_size="64M", nvme_size="256M") as process:
        yield process


# -- keys ---------------------------------------------------------------------------------

RANKS = st.builds(
    dict,
    model_name=st.sampled_from(["a/m", "b/m"]),
    tp_rank=st.integers(0, 3),
    tp_size=st.just(4),
    pp_rank=st.integers(0, 1),
    pp_size=st.just(2),
    attn_cp_rank=st.integers(0, 1),
    attn_cp_size=st.just(2),
    dp_rank=st.integers(0, 1),
    is_mla_model=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    a=RANKS, b=RANKS, salt_a=st.one_of(st.none(), st.text()), salt_b=st.one_of(st.none(), st.text())
)
def test_keys_of_other_ranks_or_tenants_never_equal(
    a: dict[str, Any], b: dict[str, Any], salt_a: str | None, salt_b: str | None
) -> None:
    def full(fields: dict[str, Any], salt: str | None) -> tuple[str, bytes]:
        ident = identity_of(config(**fields))
        return namespace_name(ident, layout="page_first", dtype="bfloat16"), page_key("h", salt)

    mla_replicas = a["is_mla_model"] and b["is_mla_model"]
    same_shard = {k: v for k, v in a.items() if k != "tp_rank" or not mla_replicas} == {
        k: v for k, v in b.items() if k != "tp_rank" or not mla_replicas
    }
    assert (full(a, salt_a) == full(b, salt_b)) == (same_shard and salt_a == salt_b)


@given(
    h1=st.text(),
    h2=st.text(),
    s1=st.one_of(st.none(), st.text()),
    s2=st.one_of(st.none(), st.text()),
)
def test_page_keys_are_injective(h1: str, h2: str, s1: str | None, s2: str | None) -> None:
    assert (page_key(h1, s1) == page_key(h2, s2)) == ((h1, s1) == (h2, s2))


# -- the ABC on a real daemon ---------------------------------------------------------------


def test_factory_builds_it_as_dynamic_backend(daemon: DaemonProcess) -> None:
    cfg = config()
    cfg.extra_config = {
        "backend_name": "kvtierd",
        "module_path": "kvtierd.engines.sglang",
        "class_name": "KvtierdHiCacheStorage",
        "interface_v1": 1,
        "socket": str(daemon.socket),
    }
    store = StorageBackendFactory.create_backend("dynamic", cfg, mem_pool_host=None)
    assert isinstance(store, KvtierdHiCacheStorage)
    assert isinstance(store, HiCacheStorage)
    pool = HostPool(8)
    store.register_mem_pool_host(pool)
    pool.fill(1)
    keys = hashes(4)
    assert store.batch_set_v1(keys, torch.arange(4 * PAGE)) == [True] * 4
    assert store.batch_exists(keys) == 4
    store.close()


def test_ported_single_operation(daemon: DaemonProcess) -> None:
    store = backend(daemon.socket)
    key, value = hashes(1)[0], pages(1)[0]
    assert not store.exists(key)
    assert store.get(key, empty_pages(1)[0]) is None
    assert store.set(key, value) is True
    assert store.exists(key)
    out = empty_pages(1)[0]
    assert store.get(key, out) is out
    assert same(out, value)
    assert store.set(key, value) is True  # already stored: skipped, still a success
    store.close()


def test_ported_batch_operation(daemon: DaemonProcess) -> None:
    store = backend(daemon.socket)
    keys, values = hashes(8), pages(8, seed=2)
    assert store.batch_set(keys[:6], values[:6]) is True
    assert store.batch_exists(keys) == 6
    assert store.batch_exists(keys[6:] + keys[:6]) == 0  # leading hits only
    got = store.batch_get(keys, empty_pages(8))
    assert all(same(g, v) for g, v in zip(got[:6], values[:6], strict=True))
    assert got[6:] == [None, None]
    stats = store.get_stats()
    kv = getattr(stats, "kvtierd", stats)
    assert (kv.pages_read, kv.pages_missed, kv.pages_written) == (6, 2, 6)
    assert {"dram"} <= {t.get("name") for t in kv.tiers}
    store.clear()
    assert store.batch_exists(keys) == 0
    store.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_ported_zero_copy_on_a_host_pool(daemon: DaemonProcess, layout: str) -> None:
    store = backend(daemon.socket, config(is_page_first_layout=layout == "page_first"))
    pool = HostPool(16, layout)
    store.register_mem_pool_host(pool)
    pool.fill(3)
    keys = hashes(6)
    src = torch.arange(2 * PAGE, 8 * PAGE)  # pages 2..7
    assert store.batch_set_v1(keys, src) == [True] * 6
    expected = [pool.get_data_page(2 * PAGE + i * PAGE).clone() for i in range(6)]
    dst = torch.arange(8 * PAGE, 16 * PAGE)  # pages 8..15, zeroed
    for i in range(8):
        pool.get_data_page(8 * PAGE + i * PAGE, flat=False).zero_()
    assert store.batch_get_v1(keys + hashes(2), dst) == [True] * 6 + [False] * 2
    for i in range(6):
        assert same(pool.get_data_page(8 * PAGE + i * PAGE), expected[i])
    # the tensor calls read the same page bytes the _v1 calls wrote
    assert same(store.batch_get(keys[:1], [pool.get_dummy_flat_data_page()])[0], expected[0])
    store.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_a_page_scribbled_after_commit_is_a_miss(daemon: DaemonProcess, layout: str) -> None:
    """``batch_get_v1`` verifies each page in the pass that copies it into the host pool (the
    page's runs, scattered): the page a client of the tenant changed after COMMIT, and those
    after it, are misses; the pages before it load intact."""
    store = backend(daemon.socket, config(is_page_first_layout=layout == "page_first"))
    pool = HostPool(16, layout)
    store.register_mem_pool_host(pool)
    pool.fill(5)
    keys = hashes(6)
    assert store.batch_set_v1(keys, torch.arange(0, 6 * PAGE)) == [True] * 6
    expected = [pool.get_data_page(i * PAGE).clone() for i in range(6)]
    scribble(store._pool_namespace(store._link.session()), [page_key(keys[3], None)])
    dst = torch.arange(8 * PAGE, 14 * PAGE)
    assert store.batch_get_v1(keys, dst) == [True] * 3 + [False] * 3
    for i in range(3):
        assert same(pool.get_data_page(8 * PAGE + i * PAGE), expected[i])
    assert store.statistics().pages_missed == 3
    assert store.batch_get(keys, empty_pages(6))[3] is None  # the tensor calls too
    store.close()


def test_a_host_layout_without_pages_is_refused_at_attach(daemon: DaemonProcess) -> None:
    store = backend(daemon.socket)
    pool = HostPool(2)
    pool.layout = "page_first_kv_split"
    with pytest.raises(ValueError, match="page_first_kv_split"):
        store.register_mem_pool_host(pool)
    store.close()


def test_tenant_salts_keep_prefixes_apart(daemon: DaemonProcess) -> None:
    store = backend(daemon.socket)
    pool = HostPool(8)
    store.register_mem_pool_host(pool)
    pool.fill(4)
    keys = hashes(3)
    alice = HiCacheStorageExtraInfo(extra_info={"cache_salt": "alice"})
    bob = HiCacheStorageExtraInfo(extra_info={"cache_salt": "bob"})
    assert all(store.batch_set_v1(keys, torch.arange(3 * PAGE), alice))
    assert store.batch_exists(keys, alice) == 3
    assert store.batch_exists(keys, bob) == 0
    assert store.batch_exists(keys) == 0  # no salt is a tenant of its own
    assert store.batch_get_v1(keys, torch.arange(3 * PAGE, 6 * PAGE), bob) == [False] * 3
    store.close()


def test_two_tp_ranks_never_share_pages(daemon: DaemonProcess) -> None:
    rank0 = backend(daemon.socket, config(tp_rank=0, tp_size=2))
    rank1 = backend(daemon.socket, config(tp_rank=1, tp_size=2))
    keys, v0, v1 = hashes(4), pages(4, seed=5), pages(4, seed=6)
    assert rank0.batch_set(keys, v0)
    assert rank1.batch_exists(keys) == 0
    assert rank1.batch_get(keys, empty_pages(4)) == [None] * 4
    assert rank1.batch_set(keys, v1)
    got0, got1 = rank0.batch_get(keys, empty_pages(4)), rank1.batch_get(keys, empty_pages(4))
    assert all(same(g, v) for g, v in zip(got0, v0, strict=True))
    assert all(same(g, v) for g, v in zip(got1, v1, strict=True))
    rank0.close()
    rank1.close()


def test_mla_pages_are_shared_by_tp_ranks(daemon: DaemonProcess) -> None:
    writer = backend(daemon.socket, config(tp_rank=0, tp_size=2, is_mla_model=True))
    reader = backend(daemon.socket, config(tp_rank=1, tp_size=2, is_mla_model=True))
    other_pp = backend(daemon.socket, config(tp_size=2, is_mla_model=True, pp_size=2, pp_rank=1))
    keys, values = hashes(2), pages(2, seed=7)
    assert writer.batch_set(keys, values)
    assert reader.batch_exists(keys) == 0  # the reader opens its namespace with its first read
    got = reader.batch_get(keys, empty_pages(2))
    assert all(same(g, v) for g, v in zip(got, values, strict=True))
    assert other_pp.batch_get(keys, empty_pages(2)) == [None, None]
    for store in (writer, reader, other_pp):
        store.close()


# -- restarts ----------------------------------------------------------------------------------


def test_byte_exact_after_a_daemon_restart(daemon: DaemonProcess) -> None:
    store = backend(daemon.socket)
    keys, values = hashes(8), pages(8, seed=8)
    assert store.batch_set(keys, values)
    pool = HostPool(4)
    store.register_mem_pool_host(pool)
    daemon.stop()
    # daemon gone: misses and failed stores, never None nor an exception into SGLang
    assert store.batch_get(keys, empty_pages(8)) == [None] * 8
    assert store.batch_exists(keys) == 0
    assert store.batch_get_v1(keys[:2], torch.arange(2 * PAGE)) == [False, False]
    assert store.batch_set_v1(hashes(2), torch.arange(2 * PAGE)) == [False, False]
    assert store.batch_set(hashes(1), pages(1)) is False
    daemon.start()
    got = store.batch_get(keys, empty_pages(8))
    assert all(g is not None and same(g, v) for g, v in zip(got, values, strict=True))
    assert store.statistics().errors >= 5
    store.close()


def test_wiped_data_directory_reads_as_misses(daemon: DaemonProcess) -> None:
    store = backend(daemon.socket)
    pool = HostPool(8)
    store.register_mem_pool_host(pool)
    pool.fill(9)
    keys = hashes(4)
    assert all(store.batch_set_v1(keys, torch.arange(4 * PAGE)))
    daemon.stop()
    shutil.rmtree(daemon.data_dir)
    daemon.start()
    assert store.batch_exists(keys) == 0
    assert store.batch_get_v1(keys, torch.arange(4 * PAGE, 8 * PAGE)) == [False] * 4
    assert store.batch_get(keys, empty_pages(4)) == [None] * 4
    assert all(store.batch_set_v1(keys, torch.arange(4 * PAGE)))  # and it stores again
    assert store.batch_exists(keys) == 4
    store.close()
