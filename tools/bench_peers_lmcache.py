"""LMCache's storage paths as drivers of the peer benchmark (``tools/bench_peers.py``).

Each driver stores N chunks, answers a lookup over all their keys, and copies chunk ``i`` into a
caller's buffer, through LMCache's own code as an engine would run it (the ``StorageManager``
drivers look up with ``pin=True`` and unpin once the last chunk is read, as LMCache's engine
does around a retrieve):

* ``LMCache CPU``: its ``StorageManager`` with ``LocalCPUBackend`` (in-process hot cache);
* ``LMCache disk`` / ``LMCache disk O_DIRECT``: ``LocalDiskBackend`` (CPU pool as staging only),
  files read buffered or with ``use_odirect``; cold = the files' pages dropped from the page
  cache (``fsync`` + ``POSIX_FADV_DONTNEED``, nothing else on the machine is touched);
* ``LMCache fs_native``: the MP-mode L2 adapter over LMCache's C++ file connector, loading into
  an L1 buffer the way its L2 controller does;
* ``LMCache TCP server``: ``python -m lmcache.v1.server`` in its own process, reached through
  ``RemoteBackend`` (``lm://``), the peer that like kvtierd serves from another process;
* ``LMCache on kvtierd``: the same ``StorageManager`` with :mod:`kvtierd.engines.lmcache` as its
  storage plug-in (the adapter's own cost on top of kvtierd).

Memory objects are LMCache's chunk shape ``[2, layers, tokens, kv_heads * head_dim]``; every
read ends with the same copy (``numpy.copyto``) out of whatever buffer the system handed back.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no usage reports from benchmark runs
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
    from lmcache.v1.distributed.l2_adapters.fs_native_l2_adapter import FSNativeL2AdapterConfig
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
    from lmcache.v1.metadata import LMCacheMetadata

__all__ = ["ChunkShape", "FsNativeDriver", "ManagerDriver", "TcpServer"]

GB = 1e9
_ids = itertools.count()


class ChunkShape:
    """A chunk layout: ``layers, kv_heads, head_dim, tokens`` in ``dtype``."""

    def __init__(
        self, name: str, layers: int, kv_heads: int, head_dim: int, tokens: int, dtype: str
    ):
        self.name, self.layers, self.kv_heads = name, layers, kv_heads
        self.head_dim, self.tokens, self.dtype = head_dim, tokens, dtype
        self.torch_dtype = getattr(torch, dtype)
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        self.nbytes = 2 * layers * kv_heads * head_dim * tokens * itemsize

    @property
    def kv_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.tokens, self.kv_heads, self.head_dim)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "tokens": self.tokens,
            "dtype": self.dtype,
            "chunk_bytes": self.nbytes,
        }


def _bytes_of(obj: Any) -> np.ndarray:
    raw: torch.Tensor = obj.raw_tensor
    return raw.reshape(-1).view(torch.uint8)[: obj.get_size()].numpy()


def _drop_page_cache(directory: Path) -> None:
    """Write back and drop the page-cache pages of every file under ``directory``."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class ManagerDriver:
    """An LMCache ``StorageManager`` (built by ``LMCacheEngine`` as an engine would) serving
    one storage location."""

    def __init__(
        self,
        name: str,
        shape: ChunkShape,
        count: int,
        location: str,
        *,
        cold_dir: Path | None = None,
        evict: Any = None,
        **config: Any,
    ) -> None:
        self.name, self.shape, self.location = name, shape, location
        self.cold = cold_dir is not None or evict is not None
        self._cold_dir, self._evict = cold_dir, evict
        self.instance = f"bench-peers-{os.getpid()}-{next(_ids)}"
        metadata = LMCacheMetadata(
            model_name=f"bench/{shape.name}",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=shape.torch_dtype,
            kv_shape=shape.kv_shape,
            chunk_size=shape.tokens,
        )
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=shape.tokens, **config)
        self.engine = LMCacheEngineBuilder.get_or_create(
            self.instance, cfg, metadata, None, None, None
        )
        self.engine.post_init()
        self.manager = self.engine.storage_manager
        self.backend = self.manager.storage_backends[location]
        self.keys = [
            CacheEngineKey(metadata.model_name, 1, 0, 1000 + i, shape.torch_dtype)
            for i in range(count)
        ]
        self._shapes = metadata.get_shapes(shape.tokens)
        self._dtypes = metadata.get_dtypes()
        self._pinned: list[Any] = []

    def write(self, chunks: list[np.ndarray], batch: int = 4) -> None:
        for start in range(0, len(chunks), batch):
            keys = self.keys[start : start + batch]
            objs = []
            for chunk in chunks[start : start + batch]:
                obj = None
                while obj is None:  # the staging pool frees as earlier writes finish
                    obj = self.manager.allocate(
                        self._shapes, self._dtypes, MemoryFormat.KV_2LTD, busy_loop=False
                    )
                    if obj is None:
                        time.sleep(0.005)
                np.copyto(_bytes_of(obj), chunk)
                objs.append(obj)
            self.manager.batched_put(keys, objs, location=None)
            self._settle(keys)

    def _settle(self, keys: list[Any]) -> None:
        """Wait until asynchronous backends (disk, remote) hold every key."""
        deadline = time.monotonic() + 120
        while not all(
            self.backend.contains(k) and not self.backend.exists_in_put_tasks(k) for k in keys
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: stores did not complete")
            time.sleep(0.002)

    def drop(self) -> None:
        self._unpin()
        if self._cold_dir is not None:
            _drop_page_cache(self._cold_dir)
        if self._evict is not None:
            self._evict()

    def lookup(self) -> int:
        """As LMCache's engine looks up a request: with ``pin``, undone once it is retrieved."""
        self._unpin()
        hits, _ = self.manager.batched_contains(self.keys, [self.location], pin=True)
        self._pinned = self.keys[: int(hits)]
        return int(hits)

    def _unpin(self) -> None:
        if self._pinned:
            self.manager.batched_unpin(self._pinned, [self.location])
            self._pinned = []

    def read(self, i: int, dst: np.ndarray) -> None:
        self.read_many(i, [dst])

    def read_many(self, first: int, dsts: list[np.ndarray]) -> None:
        objs = self.manager.batched_get(
            self.keys[first : first + len(dsts)], location=self.location
        )
        try:
            for i, (obj, dst) in enumerate(zip(objs, dsts, strict=True), first):
                if obj is None:
                    raise RuntimeError(f"{self.name}: chunk {i} missing")
                np.copyto(dst, _bytes_of(obj))
        finally:
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
        if first + len(dsts) == len(self._pinned):
            self._unpin()

    def close(self) -> None:
        self._unpin()
        LMCacheEngineBuilder.destroy(self.instance)
        with contextlib.suppress(RuntimeError):
            self.manager.loop.close()


class FsNativeDriver:
    """LMCache's MP-mode ``fs_native`` L2 adapter, loading into L1 buffers (``batch`` of them)."""

    cold = True

    def __init__(
        self,
        name: str,
        shape: ChunkShape,
        count: int,
        base: Path,
        *,
        batch: int,
        odirect: bool = False,
    ) -> None:
        self.name, self.shape, self._base = name, shape, base
        base.mkdir(parents=True, exist_ok=True)
        self.adapter = create_l2_adapter_from_registry(
            FSNativeL2AdapterConfig(str(base), num_workers=4, use_odirect=odirect)
        )
        self.keys = [
            ObjectKey((1000 + i).to_bytes(16, "big"), f"bench/{shape.name}", 0)
            for i in range(count)
        ]
        self._l1 = [self._object() for _ in range(batch)]

    def _object(self) -> Any:
        shape = torch.Size(
            [2, self.shape.layers, self.shape.tokens, self.shape.kv_heads * self.shape.head_dim]
        )
        data = torch.empty(self.shape.nbytes, dtype=torch.uint8)
        data.fill_(0)  # pre-faulted, as an L1 arena is
        meta = MemoryObjMetadata(
            shape, self.shape.torch_dtype, 0, self.shape.nbytes, 1, MemoryFormat.KV_2LTD
        )
        return TensorMemoryObj(data, meta, None)

    def _wait(self, fd: int, query: Any, task: Any) -> Any:
        while (result := query(task)) is None:
            select.select([fd], [], [], 0.05)
            with contextlib.suppress(BlockingIOError):
                os.read(fd, 8)
        return result

    def write(self, chunks: list[np.ndarray], batch: int = 4) -> None:
        for start in range(0, len(chunks), batch):
            objs = []
            for chunk in chunks[start : start + batch]:
                obj = self._object()
                np.copyto(_bytes_of(obj), chunk)
                objs.append(obj)
            task = self.adapter.submit_store_task(self.keys[start : start + batch], objs)
            done: dict[Any, Any] = {}
            while task not in done:
                select.select([self.adapter.get_store_event_fd()], [], [], 0.05)
                with contextlib.suppress(BlockingIOError):
                    os.read(self.adapter.get_store_event_fd(), 8)
                done.update(self.adapter.pop_completed_store_tasks())
            if not done[task].is_successful():
                raise RuntimeError("fs_native store failed")

    def drop(self) -> None:
        _drop_page_cache(self._base)

    def lookup(self) -> int:
        task = self.adapter.submit_lookup_and_lock_task(self.keys, {})
        bitmap = self._wait(
            self.adapter.get_lookup_and_lock_event_fd(),
            self.adapter.query_lookup_and_lock_result,
            task,
        )
        self.adapter.submit_unlock(self.keys)
        return int(bitmap.count_leading_ones())

    def read(self, i: int, dst: np.ndarray) -> None:
        self.read_many(i, [dst])

    def read_many(self, first: int, dsts: list[np.ndarray]) -> None:
        l1 = self._l1[: len(dsts)]
        task = self.adapter.submit_load_task(self.keys[first : first + len(dsts)], l1)
        bitmap = self._wait(self.adapter.get_load_event_fd(), self.adapter.query_load_result, task)
        if bitmap.count_leading_ones() < len(dsts):
            raise RuntimeError(f"{self.name}: chunks from {first} missing")
        for obj, dst in zip(l1, dsts, strict=True):
            np.copyto(dst, _bytes_of(obj))

    def close(self) -> None:
        self.adapter.close()


class TcpServer:
    """``python -m lmcache.v1.server`` on a free loopback port, in its own process."""

    def __init__(self, log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
        with open(log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(self.port), "cpu"],
                stdout=out,
                stderr=out,
                env=env,
                cwd="/",
            )
        deadline = time.monotonic() + 60
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 1),
            ):
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"LMCache's TCP server did not start (see {log})")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"lm://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)
