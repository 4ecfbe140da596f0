"""vLLM's native KV offloading (``OffloadingConnector`` with ``TieringOffloadingSpec``) on vLLM's
CPU platform, where vLLM itself refuses to run it.

This module exists only because vLLM's CPU platform has no offloading worker: vLLM 0.32's
``CPUOffloadingSpec.get_worker`` raises "CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs", and its ``CPUOffloadingWorker`` drives CUDA streams and DMA kernels.
On a GPU host none of this is needed: vLLM's own ``TieringOffloadingSpec`` runs unchanged and
:mod:`kvtierd.engines.vllm_tier` is one entry of its ``secondary_tiers``.

:class:`CpuTieringOffloadingSpec` is ``TieringOffloadingSpec`` with :class:`CpuCopyWorker` as its
worker. vLLM's "GPU" KV cache is host memory here, so a transfer between it and the CPU tier's
slots (the shared ``/dev/shm`` region both the scheduler and the worker map) is a plain tensor
copy, done synchronously when vLLM submits it: vLLM submits a store at the start of the step
after the one that computed its KV, and a load before the forward that needs it, and the CPU
forward has finished writing by then. Everything else (which blocks move, the CPU tier's LRU, the
cascade to secondary tiers) is vLLM's own code.

The functions at the bottom build the ``kv_transfer_config`` of an engine on this platform with
kvtierd (:func:`kvtierd_transfer_config`) or vLLM's built-in ``fs`` tier
(:func:`fs_transfer_config`) below the CPU tier, as JSON-able dicts
(``KVTransferConfig(**config)``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtierd.engines.vllm_tier import tier_entry

__all__ = [
    "DEFAULT_CPU_BYTES",
    "CpuCopyWorker",
    "CpuTieringOffloadingSpec",
    "fs_transfer_config",
    "kvtierd_transfer_config",
    "tiering_transfer_config",
]

#: The CPU tier's size unless told otherwise: SmolLM2's 8K-token context twice over in bf16.
DEFAULT_CPU_BYTES = 512 << 20


class CpuCopyWorker(OffloadingWorker):  # type: ignore[misc]  # vLLM is untyped
    """Moves KV blocks between vLLM's KV cache (host tensors on this platform) and the CPU tier's
    slots, synchronously: a job is finished when ``submit_*`` returns, and ``get_finished``
    reports it.

    Slot layout, as vLLM's ``CPUOffloadingWorker`` has it: one row per CPU chunk; this worker's
    part of a row holds, per KV tensor, ``blocks_per_chunk`` pages of that tensor side by side.
    """

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ) -> None:
        self._region: SharedOffloadRegion | None = region
        self._blocks_per_chunk = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._cache: list[torch.Tensor] = []  # per tensor: [num_blocks, page] int8
        self._slots: list[torch.Tensor] = []  # per tensor: [num_chunks, blocks_per_chunk, page]
        for entry in kv_caches.tensors:
            page = entry.page_size_bytes
            if entry.tensor.device.type != "cpu":
                raise ValueError(f"CpuCopyWorker needs host KV tensors, not {entry.tensor.device}")
            self._cache.append(entry.tensor.view(torch.int8).view(-1, page))
            slots = region.create_next_worker_view(page * blocks_per_chunk)
            self._slots.append(slots.unflatten(1, (blocks_per_chunk, page)))
        self._finished: list[TransferResult] = []

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self._run(job_id, src_spec, dst_spec, to_slots=True)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        self._run(job_id, dst_spec, src_spec, to_slots=False)
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished inside its submit call

    def shutdown(self) -> None:
        region, self._region = self._region, None
        self._cache.clear()
        self._slots.clear()
        if region is not None:
            if not os.path.exists(region.mmap_path):
                # The scheduler removed the name already (see CpuTieringOffloadingSpec).
                region._creator = False
            region.cleanup()

    def _run(
        self, job_id: int, cache: LoadStoreSpec, slots: LoadStoreSpec, *, to_slots: bool
    ) -> None:
        assert isinstance(cache, GPULoadStoreSpec)
        assert isinstance(slots, BlockIDsLoadStoreSpec)
        started = time.perf_counter()
        copied = self._copy(cache, slots.block_ids, to_slots=to_slots)
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=copied,
                transfer_time=time.perf_counter() - started,
            )
        )

    def _copy(self, cache: GPULoadStoreSpec, chunk_ids: np.ndarray, *, to_slots: bool) -> int:
        """Copy every group's blocks; returns the bytes copied. A group's first block may sit in
        the middle of its first chunk (``block_indices``), as in vLLM's own worker."""
        per_chunk = self._blocks_per_chunk
        block_ids = cache.block_ids
        block_at = chunk_at = copied = 0
        for group, (size, first) in enumerate(
            zip(cache.group_sizes, cache.block_indices, strict=True)
        ):
            if size == 0:
                continue
            place = np.arange(size) + first % per_chunk
            chunks_used = -(-(size + first % per_chunk) // per_chunk)
            chunks = _index(chunk_ids[chunk_at : chunk_at + chunks_used][place // per_chunk])
            within = _index(place % per_chunk)
            blocks = _index(block_ids[block_at : block_at + size])
            for ref in self._refs[group]:
                n = ref.page_size_bytes
                cache_pages = self._cache[ref.tensor_idx]
                slot_pages = self._slots[ref.tensor_idx]
                if to_slots:
                    slot_pages[chunks, within, :n] = cache_pages[blocks, :n]
                else:
                    cache_pages[blocks, :n] = slot_pages[chunks, within, :n]
                copied += size * n
            block_at += size
            chunk_at += chunks_used
        assert block_at == len(block_ids), "the cache spec names more blocks than its groups"
        assert chunk_at == len(chunk_ids), "the slots do not match the cache spec's groups"
        return copied


def _index(ids: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))


class CpuTieringOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc]  # vLLM is untyped
    """``TieringOffloadingSpec`` whose worker is :class:`CpuCopyWorker`, for vLLM's CPU platform.

    Name it in ``kv_connector_extra_config`` as ``spec_name: CpuTieringOffloadingSpec`` with
    ``spec_module_path: kvtierd.engines.vllm_cpu_offload``; everything else (``cpu_bytes_to_use``,
    ``secondary_tiers``...) is ``TieringOffloadingSpec``'s.

    One difference: vLLM keeps the CPU tier's ``/dev/shm`` file until a clean shutdown, so every
    killed engine would leave one behind. Here the second of the scheduler and a single worker to
    map it removes its name at once (the mappings stay valid), so nothing outlives the engine.
    """

    _cpu_worker: CpuCopyWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._cpu_worker is None:
            if self.config.canonical_layout:
                raise ValueError(
                    "CpuTieringOffloadingSpec copies the direct layout only: remove "
                    "canonical_layout from kv_connector_extra_config"
                )
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._cpu_worker = CpuCopyWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
            if self.config.parallel.world_size == 1 and not region._creator:
                _drop_name(region)  # the scheduler mapped it first
        return self._cpu_worker

    def get_manager(self) -> OffloadingManager:
        manager = super().get_manager()
        region = self._scheduler_mmap
        if region is not None and not region._creator:
            # vLLM registers every worker's KV caches before it builds the scheduler, so every
            # worker has mapped the region by now.
            _drop_name(region)
        return manager


def _drop_name(region: SharedOffloadRegion) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(region.mmap_path)


# -- kv_transfer_config builders ------------------------------------------------------------


def tiering_transfer_config(
    secondary_tiers: Sequence[dict[str, Any]], *, cpu_bytes: int = DEFAULT_CPU_BYTES
) -> dict[str, Any]:
    """vLLM's ``OffloadingConnector`` with a CPU tier of ``cpu_bytes`` and ``secondary_tiers``
    below it, on the CPU platform: the dict for ``KVTransferConfig(**config)``."""
    if cpu_bytes <= 0:
        raise ValueError(f"cpu_bytes must be positive, not {cpu_bytes}")
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": CpuTieringOffloadingSpec.__name__,
            "spec_module_path": __name__,
            "cpu_bytes_to_use": int(cpu_bytes),
            "secondary_tiers": [dict(tier) for tier in secondary_tiers],
        },
    }


def kvtierd_transfer_config(
    *,
    cpu_bytes: int = DEFAULT_CPU_BYTES,
    socket: str | os.PathLike[str] | None = None,
    tenant: str = "default",
    namespace: str = "vllm",
) -> dict[str, Any]:
    """kvtierd below vLLM's CPU tier (see :func:`kvtierd.engines.vllm_tier.tier_entry` for
    ``socket``, ``tenant`` and ``namespace``)."""
    entry = tier_entry(socket=socket, tenant=tenant, namespace=namespace)
    return tiering_transfer_config([entry], cpu_bytes=cpu_bytes)


def fs_transfer_config(
    root_dir: str | os.PathLike[str], *, cpu_bytes: int = DEFAULT_CPU_BYTES
) -> dict[str, Any]:
    """vLLM's built-in ``fs`` tier (one file per block under ``root_dir``, vLLM's default thread
    counts) below vLLM's CPU tier."""
    return tiering_transfer_config(
        [{"type": "fs", "root_dir": os.fspath(root_dir)}], cpu_bytes=cpu_bytes
    )
