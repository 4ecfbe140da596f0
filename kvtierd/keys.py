"""Prefix-chained block keys.

``key[i] = xxh3_128(salt || key[i-1] || tokens of block i)`` where ``key[-1]`` is empty and the
tokens are packed as little-endian ``uint32`` values. Two keys are equal only when the salts and
every token up to the end of that block are equal, so an equal key names an equal prefix. Only
full blocks get keys: a trailing partial block is never cached.

Engines that already hash their blocks (vLLM, SGLang, LMCache) may use their own keys instead,
of 1 to :data:`MAX_KEY_BYTES` bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

__all__ = ["KEY_BYTES", "MAX_KEY_BYTES", "chain_keys", "validate_key"]

#: Size of a key made by :func:`chain_keys`.
KEY_BYTES = 16
#: Largest key the protocol and the on-disk format accept.
MAX_KEY_BYTES = 32


def chain_keys(
    token_ids: Sequence[int] | Iterable[int] | np.ndarray,
    block_tokens: int,
    salt: bytes = b"",
) -> list[bytes]:
    """Return the 16-byte chained key of every full block of ``token_ids``.

    Raises ``ValueError`` when ``block_tokens`` is not positive or a token id does not fit in
    an unsigned 32-bit integer.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    tokens = np.asarray(token_ids if isinstance(token_ids, np.ndarray) else list(token_ids))
    if tokens.size and (tokens.min() < 0 or tokens.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in an unsigned 32-bit integer")
    packed = tokens.astype("<u4", copy=False).tobytes()
    stride = block_tokens * 4
    keys: list[bytes] = []
    previous = b""
    for start in range(0, (len(packed) // stride) * stride, stride):
        hasher = xxhash.xxh3_128(salt)
        hasher.update(previous)
        hasher.update(packed[start : start + stride])
        previous = hasher.digest()
        keys.append(previous)
    return keys


def validate_key(key: bytes) -> bytes:
    """Return ``key`` if it is 1 to :data:`MAX_KEY_BYTES` bytes long, else raise ``ValueError``."""
    if not isinstance(key, bytes | bytearray | memoryview) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a block key is 1 to {MAX_KEY_BYTES} bytes")
    return bytes(key)
