"""Block summaries: element-wise minimum, maximum and mean key per layer and KV head of a block.

A summary is what the sparse index keeps of a block instead of its keys: three vectors of
``head_dim`` per (layer, KV head). The minimum and maximum give an axis-aligned box that holds
every key of the block, which bounds (Quest) or estimates (:mod:`.scoring`) the attention a query
pays the block; the mean key is the cheap centroid used for hashing and as a baseline.

Memory order of a block (the contract with the store and the engine adapters): the bytes of a
block are layer-major; for each layer ``l`` in ``0..layers-1`` come its K then its V, each a
C-contiguous ``[kv_heads, block_tokens, head_dim]`` array of ``dtype``. So K of layer ``l``
starts at byte ``2 * l * plane_bytes``, ``plane_bytes = kv_heads * block_tokens * head_dim *
itemsize``.
Keys are post-RoPE, exactly as the engine's attention reads them. ``bfloat16`` is read as
``uint16`` (numpy has no bfloat16) and widened to float32 exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtierd.errors import InvalidRequestError

__all__ = [
    "BlockLayout",
    "BlockSummary",
    "keys_from_block",
    "summarize_block",
    "summarize_keys",
    "summarize_sequence",
]

F32 = npt.NDArray[np.float32]
_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class BlockLayout:
    """Shape of one block's bytes (see the module docstring for the memory order).

    Attributes:
        layers: transformer layers in the block.
        kv_heads: KV heads on this tensor-parallel rank.
        head_dim: elements per head.
        block_tokens: tokens per block.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
    """

    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim, self.block_tokens) <= 0:
            raise InvalidRequestError(f"layout dimensions must be positive: {self}")
        if self.dtype not in _DTYPES:
            raise InvalidRequestError(f"unsupported dtype {self.dtype!r}; one of {sorted(_DTYPES)}")

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype]

    @property
    def plane_bytes(self) -> int:
        """Bytes of the K (or V) part of one layer."""
        return self.kv_heads * self.block_tokens * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of a whole block (K and V of every layer)."""
        return 2 * self.layers * self.plane_bytes


@dataclass(frozen=True)
class BlockSummary:
    """Per (layer, KV head): element-wise min, max and mean of the block's keys.

    Each array is float32 ``[layers, kv_heads, head_dim]``. ``tokens`` is how many keys were
    summarised (``block_tokens`` for a full block).
    """

    minimum: F32
    maximum: F32
    mean: F32
    tokens: int

    def __post_init__(self) -> None:
        shape = self.minimum.shape
        if len(shape) != 3 or self.maximum.shape != shape or self.mean.shape != shape:
            raise InvalidRequestError(
                "summary arrays must share one [layers, kv_heads, head_dim] shape, got "
                f"{self.minimum.shape}, {self.maximum.shape}, {self.mean.shape}"
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        layers, kv_heads, head_dim = self.minimum.shape
        return layers, kv_heads, head_dim

    def stacked(self) -> F32:
        """The three vectors as one float32 ``[layers, kv_heads, 3, head_dim]`` array
        (min, max, mean): the form :class:`~.index.SparseIndex` stores."""
        return np.stack([self.minimum, self.maximum, self.mean], axis=2)


def keys_from_block(
    data: bytes | bytearray | memoryview | npt.NDArray[np.generic], layout: BlockLayout
) -> F32:
    """The keys of one block as float32 ``[layers, kv_heads, block_tokens, head_dim]``.

    ``data`` holds exactly ``layout.block_bytes`` bytes in the documented memory order; it is
    read without copying the V planes.

    Raises:
        InvalidRequestError: ``data`` has the wrong length.
    """
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    raw = raw.reshape(-1).view(np.uint8)
    if raw.nbytes != layout.block_bytes:
        raise InvalidRequestError(
            f"block has {raw.nbytes} bytes, layout {layout} needs {layout.block_bytes}"
        )
    planes = raw.reshape(layout.layers, 2, layout.plane_bytes)[:, 0]
    shape = (layout.layers, layout.kv_heads, layout.block_tokens, layout.head_dim)
    if layout.dtype == "bfloat16":
        bits = np.ascontiguousarray(planes).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.ascontiguousarray(planes).view(layout.dtype).reshape(shape).astype(np.float32)


def summarize_keys(keys: npt.NDArray[np.floating], tokens: int | None = None) -> BlockSummary:
    """Summarise the keys of one block.

    Args:
        keys: ``[layers, kv_heads, tokens, head_dim]``, any float dtype, post-RoPE.
        tokens: summarise only the first ``tokens`` keys (a partial block); default all.

    Raises:
        InvalidRequestError: ``keys`` is not 4-D or has no token to summarise.
    """
    if keys.ndim != 4:
        raise InvalidRequestError(
            f"keys must be [layers, kv_heads, tokens, head_dim], got {keys.shape}"
        )
    n = keys.shape[2] if tokens is None else tokens
    if not 0 < n <= keys.shape[2]:
        raise InvalidRequestError(f"cannot summarise {n} of {keys.shape[2]} tokens")
    k = np.asarray(keys[:, :, :n], dtype=np.float32)
    return BlockSummary(
        minimum=k.min(axis=2),
        maximum=k.max(axis=2),
        mean=k.mean(axis=2, dtype=np.float32),
        tokens=n,
    )


def summarize_block(
    data: bytes | bytearray | memoryview | npt.NDArray[np.generic], layout: BlockLayout
) -> BlockSummary:
    """Summarise one block given as bytes in the documented memory order (see
    :func:`keys_from_block` for what it takes and raises)."""
    return summarize_keys(keys_from_block(data, layout))


def summarize_sequence(keys: npt.NDArray[np.floating], block_tokens: int) -> F32:
    """Summaries of every full block of a sequence, in one vectorised pass.

    Args:
        keys: ``[layers, kv_heads, tokens, head_dim]`` for a whole sequence.
        block_tokens: tokens per block; a trailing partial block is not summarised.

    Returns:
        float32 ``[blocks, layers, kv_heads, 3, head_dim]`` (min, max, mean), the stacked form.
    """
    layers, kv_heads, n, head_dim = keys.shape
    blocks = n // block_tokens
    k = np.asarray(keys[:, :, : blocks * block_tokens], dtype=np.float32)
    k = k.reshape(layers, kv_heads, blocks, block_tokens, head_dim)
    out = np.stack([k.min(axis=3), k.max(axis=3), k.mean(axis=3, dtype=np.float32)], axis=3)
    return np.ascontiguousarray(out.transpose(2, 0, 1, 3, 4))
