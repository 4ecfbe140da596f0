"""What a block's :class:`~kvtierd.protocol.messages.Layout` says about its size.

One table of dtype sizes, read by the daemon (which checks a namespace's ``block_bytes``
against its layout) and by the client (which derives ``block_bytes`` from a layout), so the two
can never disagree. A dtype not in the table is still a valid layout; its blocks are then sized
by the caller alone.
"""

from __future__ import annotations

from kvtierd.protocol.messages import Layout

__all__ = ["DTYPE_BYTES", "layout_block_bytes"]

#: Bytes per element of the dtypes a layout may name.
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def layout_block_bytes(layout: Layout) -> int | None:
    """Bytes of one block of ``layout``: K and V of every layer and KV head for
    ``block_tokens`` tokens (``2 * layers * kv_heads * head_dim * block_tokens * dtype size``);
    ``None`` for a dtype not in :data:`DTYPE_BYTES`."""
    itemsize = DTYPE_BYTES.get(layout.dtype)
    if itemsize is None:
        return None
    return 2 * layout.layers * layout.kv_heads * layout.head_dim * layout.block_tokens * itemsize
