"""Moving K/V between transformers' ``DynamicCache`` and kvtierd's layer-major blocks.

A block is a C-contiguous ``[2L, kv_heads, block_tokens, head_dim]`` tensor: plane ``2l`` is
layer ``l``'s K, plane ``2l + 1`` its V. A cache layer is ``[1, kv_heads, tokens, head_dim]``.
Block ``b`` of a layer is therefore the token slice ``[b * bt, (b + 1) * bt)``; a run of ``n``
adjacent blocks, seen as ``[kv_heads, n, bt, head_dim]`` (a split of the token dimension, always
a view), matches the run's plane permuted to heads-first.

Restore direction: :class:`RestoredLayer` keeps the prefix in the leased arena blocks; the first
layer the forward reaches copies every plane of every run at once (one strided ``copy_`` per
run: the daemon may scatter blocks over the arena, and a copy per block and plane would cost
thousands of calls) into one tensor that also has room for the forward's new states.
Store direction: :func:`gather_blocks` copies token ranges of a cache into block order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = [
    "ArenaPrefix",
    "BlockRun",
    "RestoredLayer",
    "gather_blocks",
    "prefix_cache",
    "restored_cache",
]


@dataclass(frozen=True)
class BlockRun:
    """Adjacent blocks holding tokens ``[start, start + tokens)``.

    ``view`` is ``[blocks, 2L, kv_heads, block_tokens, head_dim]`` in the model's dtype; the
    last block may be used only in part (``tokens`` need not be a multiple of the block size).
    """

    start: int
    tokens: int
    view: torch.Tensor


@dataclass
class ArenaPrefix:
    """The restored prefix that every :class:`RestoredLayer` of one cache still points into.

    The first layer to need its tensors copies the whole prefix, every plane, out of the arena
    into one ``[2L, kv_heads, tokens + extra, head_dim]`` tensor (``planes``), one strided copy
    per run however the daemon placed the blocks; each layer then keeps views of its two
    planes. ``pending_layers`` counts the layers that still point into the arena: the lease on
    the blocks may go only when it is 0 (or after :meth:`RestoredLayer.discard`).
    """

    runs: list[BlockRun]
    tokens: int
    block_tokens: int
    pending_layers: int
    planes: torch.Tensor | None = None
    extra: int = 0

    def copy_out(self, extra: int) -> torch.Tensor:
        """``planes``, copied out of the arena on the first call with room for ``extra`` more
        tokens after the prefix."""
        if self.planes is None:
            first = self.runs[0].view
            count, heads, head_dim = first.shape[1], first.shape[2], first.shape[4]
            shape = (count, heads, self.tokens + extra, head_dim)
            planes = torch.empty(shape, dtype=first.dtype)
            for run in self.runs:
                _copy_run(planes, run, self.block_tokens)
            self.planes, self.extra = planes, extra
        return self.planes


def _copy_run(planes: torch.Tensor, run: BlockRun, bt: int) -> None:
    """Copy ``run`` (``[blocks, 2L, heads, bt, dim]``) into ``planes`` ``[2L, heads, T, dim]``."""
    count, heads, _, head_dim = planes.shape
    full, rest = divmod(run.tokens, bt)
    if full:
        target = planes[:, :, run.start : run.start + full * bt, :]
        target.view(count, heads, full, bt, head_dim).copy_(run.view[:full].permute(1, 2, 0, 3, 4))
    if rest:
        begin = run.start + full * bt
        planes[:, :, begin : begin + rest, :].copy_(run.view[full, :, :, :rest, :])


class RestoredLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A ``DynamicLayer`` whose first ``tokens`` positions still lie in leased arena blocks.

    Its first ``update`` (the forward over the suffix) takes views of its planes in the
    prefix's copy (:meth:`ArenaPrefix.copy_out`, made by the first layer with room for the new
    tokens) and writes the new states after the prefix: one copy of the prefix, the same one
    ``DynamicLayer`` makes with ``torch.cat``. Reading ``keys`` or ``values`` earlier copies the
    prefix alone. From then on it is a plain ``DynamicLayer``.
    """

    def __init__(self, prefix: ArenaPrefix, index: int) -> None:
        self._prefix: ArenaPrefix | None = prefix
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._index = index
        super().__init__()  # type: ignore[no-untyped-call]
        first = prefix.runs[0].view
        self.device = first.device
        self.dtype = first.dtype
        self.is_initialized = True

    # ``DynamicLayer`` assigns and reads ``keys``/``values`` as plain attributes.
    @property
    def keys(self) -> torch.Tensor | None:
        if self._prefix is not None:
            self._materialise(None, None)
        return self._keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._keys = value

    @property
    def values(self) -> torch.Tensor | None:
        if self._prefix is not None:
            self._materialise(None, None)
        return self._values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._values = value

    @property
    def pending(self) -> bool:
        """Whether the prefix still lies in the arena (its lease must be held)."""
        return self._prefix is not None

    def get_seq_length(self) -> int:
        if self._prefix is not None:
            return self._prefix.tokens
        return int(super().get_seq_length())

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._prefix is None:
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            return keys, values
        if key_states.shape[0] != 1:
            raise ValueError("a restored cache holds one sequence (batch size 1)")
        self._materialise(key_states, value_states)
        assert self._keys is not None
        assert self._values is not None
        return self._keys, self._values

    def discard(self) -> None:
        """Drop the arena prefix without copying it. The layer is left empty and its cache must
        be thrown away; for when the forward failed and the lease is about to go."""
        if self._prefix is not None:
            self._prefix.pending_layers -= 1
            self._prefix = None
        self._keys = self._values = None
        self.is_initialized = False

    def _materialise(self, new_keys: torch.Tensor | None, new_values: torch.Tensor | None) -> None:
        prefix = self._prefix
        assert prefix is not None
        extra = 0 if new_keys is None else new_keys.shape[-2]
        planes = prefix.copy_out(extra)
        keys, values = planes[2 * self._index], planes[2 * self._index + 1]
        tokens = prefix.tokens
        if prefix.extra == extra:
            if new_keys is not None and new_values is not None:
                keys[:, tokens:, :].copy_(new_keys[0])
                values[:, tokens:, :].copy_(new_values[0])
            self._keys, self._values = keys[None], values[None]
        else:  # copied out earlier with another length: the prefix, then the usual append
            self._keys, self._values = keys[None, :, :tokens], values[None, :, :tokens]
            if new_keys is not None and new_values is not None:
                self._keys = torch.cat([self._keys, new_keys], dim=-2)
                self._values = torch.cat([self._values, new_values], dim=-2)
        prefix.pending_layers -= 1
        self._prefix = None


def restored_cache(
    config: Any, layers: int, runs: Sequence[BlockRun], block_tokens: int
) -> tuple[DynamicCache, ArenaPrefix]:
    """A ``DynamicCache`` for ``config`` whose layers hold ``runs`` (which must cover
    ``[0, tokens)`` in order) without copying them yet."""
    tokens = runs[-1].start + runs[-1].tokens
    prefix = ArenaPrefix(list(runs), tokens, block_tokens, layers)
    cache = DynamicCache(config=config)
    cache.layers = [RestoredLayer(prefix, i) for i in range(layers)]
    return cache, prefix


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
    copy: the next forward copies them, as it would a cache kept in memory). ``cache`` itself
    is left as it is. The resident reference that restored caches are measured against."""
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
