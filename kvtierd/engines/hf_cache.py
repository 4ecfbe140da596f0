"""Moving K/V between transformers' caches and kvtierd's layer-major blocks.

A block is a C-contiguous ``[2L, kv_heads, block_tokens, head_dim]`` tensor: plane ``2l`` is
layer ``l``'s K, plane ``2l + 1`` its V. A cache layer is ``[1, kv_heads, tokens, head_dim]``.
Block ``b`` of a layer is therefore the token slice ``[b * bt, (b + 1) * bt)``; a run of ``n``
adjacent blocks, seen as ``[kv_heads, n, bt, head_dim]`` (a split of the token dimension, always
a view), matches the run's plane permuted to heads-first.

The cache the adapter builds is a :class:`KvSlab`: one preallocated, pre-faulted
``[2L, kv_heads, capacity, head_dim]`` tensor, every layer a :class:`SlabLayer` over two of its
planes. Restoring copies each leased run of blocks into the slab with one strided ``copy_``
(every plane at once: the daemon may scatter blocks over the arena, and a copy per block and
plane would cost thousands of calls); the forward then appends its new states in place, as do
later decode steps, until the capacity is reached (then the layer moves to a larger buffer).
Nothing is concatenated and no fresh memory is touched on the way to the first token.
Store direction: :func:`gather_blocks` copies token ranges of a cache into block order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from kvtierd.client.arena import ByteRuns, copy_verified
from kvtierd.engines.host_runs import HostRuns

__all__ = [
    "BlockRun",
    "KvSlab",
    "SlabLayer",
    "copy_run",
    "copy_verified_blocks",
    "gather_blocks",
    "prefix_cache",
    "resident_cache",
    "slab_cache",
]

#: Tokens a layer that outgrows its slab gains beyond what it needs (at least).
_GROWTH_TOKENS = 256


@dataclass(frozen=True)
class BlockRun:
    """Adjacent blocks holding tokens ``[start, start + tokens)``.

    ``view`` is ``[blocks, 2L, kv_heads, block_tokens, head_dim]`` in the model's dtype; the
    last block may be used only in part (``tokens`` need not be a multiple of the block size).
    """

    start: int
    tokens: int
    view: torch.Tensor


class KvSlab:
    """The K/V memory of one sequence: ``planes`` ``[2L, kv_heads, capacity, head_dim]``.

    Allocated once and pre-faulted (every page written), so neither the restore's copy nor the
    forward touches fresh memory: first touch of anonymous memory runs at 1-3 GB/s on the
    machines here, several times slower than copying into memory already mapped.
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (2 * layers, kv_heads, capacity, head_dim)
        self.planes = torch.empty(shape, dtype=dtype, device=device)
        if self.planes.device.type == "cpu":  # one write per page faults it
            self.planes.view(torch.uint8).view(-1)[::4096].zero_()

    @property
    def capacity(self) -> int:
        return int(self.planes.shape[2])

    def fits(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> bool:
        planes = self.planes
        shape = (int(planes.shape[0]), int(planes.shape[1]), int(planes.shape[3]))
        same_device = planes.device == torch.device(device)
        return planes.dtype == dtype and shape == (2 * layers, kv_heads, head_dim) and same_device


def copy_run(planes: torch.Tensor, run: BlockRun, bt: int) -> None:
    """Copy ``run`` (``[blocks, 2L, heads, bt, dim]``) into ``planes`` ``[2L, heads, T, dim]``."""
    count, heads, _, head_dim = planes.shape
    full, rest = divmod(run.tokens, bt)
    if full:
        target = planes[:, :, run.start : run.start + full * bt, :]
        target.view(count, heads, full, bt, head_dim).copy_(run.view[:full].permute(1, 2, 0, 3, 4))
    if rest:
        begin = run.start + full * bt
        planes[:, :, begin : begin + rest, :].copy_(run.view[full, :, :, :rest, :])


def copy_verified_blocks(
    planes: torch.Tensor,
    blocks: Sequence[memoryview],
    checksums: Sequence[int],
    first: int,
    bt: int,
    limit: int,
) -> tuple[int, bool]:
    """Copy whole leased blocks (``[2L, heads, bt, dim]`` bytes each) into host ``planes``
    ``[2L, heads, T, dim]`` from token ``first * bt`` on, each hashed in the pass that copies it:
    one native call a block into its 2L x heads runs (:class:`ByteRuns`, block 0's runs shifted
    along the token axis), where hashing and then one strided torch copy ran at half the speed.
    Stops before a block that starts at ``limit`` or ends past the slab (those are the caller's)
    and at a block that fails its checksum; returns (blocks copied, whether one failed)."""
    storage, spans = HostRuns(keep=1).spans(planes[:, :, :bt, :])  # not kept: slabs are big
    starts = [a for a, _ in spans]
    length = spans[0][1] - spans[0][0] if spans else 0
    token_bytes = planes.stride(2) * planes.element_size()
    for i, (block, expected) in enumerate(zip(blocks, checksums, strict=True)):
        start = (first + i) * bt
        if start >= limit or start + bt > planes.shape[2]:
            return i, False
        shift = start * token_bytes
        if not copy_verified(
            block, ByteRuns(storage, [a + shift for a in starts], length), expected
        ):
            return i, True
    return len(blocks), False


class SlabLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A ``DynamicLayer`` whose K and V live in preallocated ``[1, kv_heads, capacity,
    head_dim]`` buffers: ``keys``/``values`` are views of their first ``length`` positions and
    ``update`` writes the new states after them in place (no ``torch.cat``).

    Anything ``DynamicLayer`` does to ``keys``/``values`` keeps working: a crop leaves a shorter
    view of the same buffer (appends continue after it); any other tensor assigned to them is
    moved into a buffer of this layer's own at the next ``update``.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._key_buffer, self._value_buffer = keys, values
        self.device, self.dtype = keys.device, keys.dtype
        self.is_initialized = True
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def _length_in_buffer(self) -> int | None:
        """``keys``' length when ``keys``/``values`` are still prefix views of the buffers."""
        keys, values = self.keys, self.values
        if keys is None or values is None or (keys.numel() == 0 and values.numel() == 0):
            return 0  # (an empty view's data_ptr() is 0)
        for tensor, buffer in ((keys, self._key_buffer), (values, self._value_buffer)):
            if (
                tensor.data_ptr() != buffer.data_ptr()
                or tensor.stride() != buffer.stride()
                or tensor.shape[:2] != buffer.shape[:2]
                or tensor.shape[3] != buffer.shape[3]
            ):
                return None
        return int(keys.shape[2])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[0] != self._key_buffer.shape[0] or key_states.dtype != self.dtype:
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            return keys, values
        length = self._length_in_buffer()
        new = key_states.shape[-2]
        capacity = self._key_buffer.shape[2]
        if length is None or length + new > capacity:
            self._move(new)
            length = self._length_in_buffer()
            assert length is not None
        end = length + new
        self._key_buffer[:, :, length:end].copy_(key_states)
        self._value_buffer[:, :, length:end].copy_(value_states)
        self.is_initialized = True
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values

    def _move(self, extra: int) -> None:
        """Into buffers of this layer's own with room for ``extra`` more tokens."""
        keys, values = self.keys, self.values
        length = 0 if keys is None else int(keys.shape[2])
        capacity = length + extra + max(_GROWTH_TOKENS, length // 4)
        shape = (*self._key_buffer.shape[:2], capacity, self._key_buffer.shape[3])
        self._key_buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._value_buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        if keys is not None and values is not None and length:
            self._key_buffer[:, :, :length].copy_(keys)
            self._value_buffer[:, :, :length].copy_(values)
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]

    def reset(self) -> None:
        super().reset()
        self.keys = self._key_buffer[:, :, :0]
        self.values = self._value_buffer[:, :, :0]
        self.is_initialized = True


def slab_cache(config: Any, slab: KvSlab, length: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose layers are :class:`SlabLayer`\\ s over ``slab``,
    holding its first ``length`` positions (already written there)."""
    planes = slab.planes
    if length > slab.capacity:
        raise ValueError(f"a slab of {slab.capacity} tokens cannot hold {length}")
    cache = DynamicCache(config=config)
    cache.layers = [
        SlabLayer(planes[2 * i][None], planes[2 * i + 1][None], length)
        for i in range(planes.shape[0] // 2)
    ]
    cache.kvtierd_slab = slab  # type: ignore[attr-defined]
    return cache


def gather_blocks(
    cache: DynamicCache, start: int, out: torch.Tensor, *, expected_dtype: torch.dtype
) -> None:
    """Copy the tokens ``[start, start + n * bt)`` of every layer of ``cache`` into ``out``
    ``[n, 2L, kv_heads, bt, head_dim]`` (block order).

    Raises:
        ValueError: the cache's layer count, head count, head dim or dtype is not ``out``'s
            (a cache is never converted), or it holds fewer tokens.
    """
    count, planes, heads, bt, head_dim = out.shape
    if 2 * len(cache.layers) != planes:
        raise ValueError(f"the cache has {len(cache.layers)} layers, the layout {planes // 2}")
    for index, layer in enumerate(cache.layers):
        for half, tensor in enumerate(
            (getattr(layer, "keys", None), getattr(layer, "values", None))
        ):
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != expected_dtype:
                found = getattr(tensor, "dtype", None)
                raise ValueError(f"cache layer {index} holds {found}, the layout {expected_dtype}")
            if tensor.shape[1] != heads or tensor.shape[3] != head_dim:
                raise ValueError(f"cache layer {index} has shape {tuple(tensor.shape)}")
            if tensor.shape[2] < start + count * bt:
                raise ValueError(f"cache layer {index} holds {tensor.shape[2]} tokens")
            source = tensor[0, :, start : start + count * bt, :].reshape(heads, count, bt, head_dim)
            out[:, 2 * index + half].copy_(source.permute(1, 0, 2, 3))


def prefix_cache(config: Any, cache: DynamicCache, tokens: int) -> DynamicCache:
    """A new ``DynamicCache`` holding views of the first ``tokens`` positions of ``cache`` (no
    copy: the next forward concatenates onto them, as a plain ``DynamicCache`` kept in memory
    does). ``cache`` itself is left as it is. The reference the tests and the fidelity tool
    compare restored caches against: another cache class than the adapter's, so that equal
    logits also show that the in-place cache computes exactly what ``DynamicCache`` does."""
    layers: list[Any] = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ValueError("the cache has an empty layer")
        if keys.shape[-2] < tokens:
            raise ValueError(f"the cache holds {keys.shape[-2]} tokens, not {tokens}")
        target = DynamicLayer()  # type: ignore[no-untyped-call]
        target.lazy_initialization(keys, values)
        target.keys, target.values = keys[:, :, :tokens, :], values[:, :, :tokens, :]
        layers.append(target)
    out = DynamicCache(config=config)
    out.layers = layers
    return out


def resident_cache(config: Any, cache: DynamicCache, tokens: int, slab: KvSlab) -> DynamicCache:
    """The first ``tokens`` positions of ``cache`` copied into ``slab``, as the adapter's own
    kind of cache: what a restore builds, had the prefix been kept in memory all along (the
    reference of the TTFT limit: the same cache, so the same forward)."""
    planes = slab.planes
    for index, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            raise ValueError("the cache has an empty layer")
        planes[2 * index, :, :tokens].copy_(keys[0, :, :tokens])
        planes[2 * index + 1, :, :tokens].copy_(values[0, :, :tokens])
    return slab_cache(config, slab, tokens)
