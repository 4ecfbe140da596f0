"""LMCache's own keys and metadata, as kvtierd block keys and namespaces (no re-hashing).

An LMCache chunk is named by a ``CacheEngineKey``: ``model_name``, ``world_size``,
``worker_id``, ``dtype``, optional ``lmcache.tag.*`` tags, and ``chunk_hash``, the prefix-chained
hash LMCache's token database computed over the chunk and everything before it (so equal hashes
mean equal prefixes, exactly what a kvtierd key promises). The mapping here keeps every part:

* ``chunk_hash`` becomes the key bytes unchanged: an ``int`` (LMCache's ``builtin`` hash is
  signed 64-bit, ``sha256_cbor`` keeps 8 bytes of the digest) as 16 bytes of big-endian two's
  complement, ``bytes`` as they are (1-32 bytes). Nothing is hashed again.
* the rest of the key, with the engine's metadata (KV shape, chunk tokens) and the hash algorithm,
  becomes the namespace: ``worker_id`` and ``world_size`` are kvtierd's rank and world size (so
  a LOOKUP answers for the whole TP group, as LMCache's own lookup does), the dtype and shape are
  the namespace layout, and the model, hash algorithm and tags are its name. Keys that differ in
  any of these can therefore never meet in one namespace.

This module is pure (no I/O, no LMCache import): :mod:`kvtierd.engines.lmcache` feeds it the
LMCache objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvtierd.engines.link import NamespaceSpec
from kvtierd.protocol.messages import Layout

__all__ = [
    "BLOCK_ORDER",
    "UnsupportedKeyError",
    "block_key",
    "dtype_name",
    "namespace_spec",
]

#: LMCache's chunk memory format ``KV_2LTD``: ``[2 (K, V), layers, tokens, kv_heads * head_dim]``.
BLOCK_ORDER = "lmcache-kv_2ltd"
_INT_KEY_BYTES = 16
_MAX_KEY_BYTES = 32
_MAX_NAME = 255


class UnsupportedKeyError(ValueError):
    """A key this mapping cannot represent without hashing it (a bad chunk hash, a layer key)."""


def block_key(chunk_hash: int | bytes) -> bytes:
    """The kvtierd key of an LMCache chunk hash: the same value, as bytes."""
    if isinstance(chunk_hash, bytes):
        if not 1 <= len(chunk_hash) <= _MAX_KEY_BYTES:
            raise UnsupportedKeyError(f"a {len(chunk_hash)}-byte chunk hash is not a kvtierd key")
        return chunk_hash
    try:
        return int(chunk_hash).to_bytes(_INT_KEY_BYTES, "big", signed=True)
    except OverflowError:
        raise UnsupportedKeyError(f"chunk hash {chunk_hash:#x} needs more than 128 bits") from None


def dtype_name(dtype: Any) -> str:
    """``torch.float16`` -> ``"float16"`` (kvtierd's dtype names)."""
    return str(dtype).removeprefix("torch.")


def _tag_suffix(tags: Iterable[tuple[str, Any]] | None) -> str:
    if not tags:
        return ""
    return "?" + "&".join(f"{k}={v}" for k, v in sorted(tags))


def namespace_spec(
    *,
    model_name: str,
    world_size: int,
    worker_id: int,
    dtype: Any,
    tags: Iterable[tuple[str, Any]] | None,
    kv_shape: Sequence[int],
    chunk_tokens: int,
    chunk_bytes: int,
    hash_algorithm: str,
    single_group: bool,
) -> NamespaceSpec:
    """The namespace of one LMCache key group (see the module docstring).

    ``kv_shape`` is LMCache's ``(layers, 2 or 1 (MLA), chunk tokens, kv_heads, head_dim)``;
    ``chunk_bytes`` the size of a full chunk. A layout is declared when the chunk is the plain
    K+V form kvtierd can check (one layer group, not MLA), so the daemon verifies
    ``2 * layers * kv_heads * head_dim * tokens * itemsize == chunk_bytes``; otherwise the
    shape goes into the name instead.
    """
    layers, kv, _, kv_heads, head_dim = (int(x) for x in kv_shape)
    dtype_str = dtype_name(dtype)
    layout: Layout | None = None
    shape_part = ""
    if single_group and kv == 2:
        layout = Layout(
            model_name[:_MAX_NAME], layers, kv_heads, head_dim, dtype_str, chunk_tokens, BLOCK_ORDER
        )
    else:
        shape_part = f"/{dtype_str}[{layers},{kv},{chunk_tokens},{kv_heads},{head_dim}]"
    name = f"lmcache/{model_name}/{hash_algorithm}{shape_part}{_tag_suffix(tags)}"
    if len(name) > _MAX_NAME:
        raise UnsupportedKeyError(f"namespace name longer than {_MAX_NAME} characters: {name!r}")
    return NamespaceSpec(name, chunk_bytes, layout, worker_id, world_size)
