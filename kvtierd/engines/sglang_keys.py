"""SGLang HiCache page keys as kvtierd namespaces and block keys (pure: no I/O, no SGLang import).

SGLang names an L3 page by a hash string of its tokens and of every page before it
(``get_hash_str``), the same on every rank. What the page *holds* depends on more: the model, the
rank's shard (TP, PP, attention-CP and DCP rank and size, the DP group), whether the model is MLA
(whose KV every TP rank replicates) and the host pool's page layout and dtype. SGLang's shipped
file backend folds only some of these into its file names (not the DP rank, the dtype or the
layout), and L3 keys built from tokens alone let one tenant (``cache_salt``) time another's
prefix (sglang#37160; 0.5.23 seeds its page hashes with the salt, and passes none to backends).

Here every part is kept, in two places the daemon keeps apart:

* the **namespace** (:func:`namespace_name` plus the kvtierd tenant) holds the model, every rank
  and size, the MLA flag, the layout, the dtype and the pool (a hybrid model's Mamba,
  sliding-window or indexer pages each have their own); its block size is the page size. Two ranks
  or models therefore never share a namespace, so never a block. An MLA page has one namespace
  for all TP ranks of a DP group (the KV is replicated; SGLang lets one rank write it), but
  still one per PP stage, CP and DCP shard.
* the **key** (:func:`page_key`) is a 32-byte BLAKE2b of the request's ``cache_salt`` and the
  page hash, each length-prefixed, so two tenants of one SGLang server (one kvtierd tenant)
  get different keys for the same tokens, and no salt/hash pair can be made to look like
  another.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KV_POOL",
    "MAMBA_POOL",
    "StorageIdentity",
    "cache_salt_of",
    "identity_of",
    "namespace_name",
    "page_key",
]

#: SGLang's ``PoolName`` values this module treats apart.
KV_POOL = "kv"
MAMBA_POOL = "mamba"
_KEY_BYTES = 32
_KEY_DOMAIN = b"kvtierd/sglang/page/1"
_MAX_NAME = 255


@dataclass(frozen=True, slots=True)
class StorageIdentity:
    """Everything about one SGLang rank that decides what its pages hold."""

    model: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dcp_rank: int
    dcp_size: int
    is_mla: bool
    page_first: bool


def identity_of(config: Any) -> StorageIdentity:
    """The identity of a ``HiCacheStorageConfig`` (read by attribute, so any version's)."""
    return StorageIdentity(
        model=str(config.model_name or ""),
        tp_rank=int(config.tp_rank),
        tp_size=int(config.tp_size),
        pp_rank=int(config.pp_rank),
        pp_size=int(config.pp_size),
        cp_rank=int(getattr(config, "attn_cp_rank", 0)),
        cp_size=int(getattr(config, "attn_cp_size", 1)),
        dp_rank=int(getattr(config, "dp_rank", 0)),
        dcp_rank=int(getattr(config, "dcp_rank", 0)),
        dcp_size=int(getattr(config, "dcp_size", 1)),
        is_mla=bool(config.is_mla_model),
        page_first=bool(config.is_page_first_layout),
    )


def namespace_name(
    identity: StorageIdentity, *, layout: str, dtype: str, pool: str = KV_POOL
) -> str:
    """The kvtierd namespace of ``identity``'s pages of ``pool`` (SGLang's ``PoolName``: the KV
    pages, or a hybrid model's Mamba, sliding-window, indexer... pool) stored in ``layout``
    with ``dtype``. The KV pool's name has no pool part (the names of earlier releases).

    Raises ``ValueError`` when the name would pass kvtierd's 255 characters (a model name of
    over ~150 characters)."""
    i = identity
    # MLA KV is the same on every TP rank of a group: one namespace, written by one rank. A
    # Mamba state is the rank's own shard even then (as SGLang's file backend keys it).
    replicated = i.is_mla and pool != MAMBA_POOL
    tp = f"mla-tp{i.tp_size}" if replicated else f"tp{i.tp_rank}of{i.tp_size}"
    parts = [
        "sglang",
        i.model,
        tp,
        f"pp{i.pp_rank}of{i.pp_size}",
        f"cp{i.cp_rank}of{i.cp_size}",
        f"dcp{i.dcp_rank}of{i.dcp_size}",
        f"dp{i.dp_rank}",
        layout,
        dtype,
    ]
    if pool != KV_POOL:
        parts.append(f"pool-{pool}")
    name = "/".join(parts)
    if len(name) > _MAX_NAME:
        raise ValueError(f"namespace name longer than {_MAX_NAME} characters: {name!r}")
    return name


def _framed(part: bytes) -> bytes:
    return len(part).to_bytes(4, "big") + part


def page_key(page_hash: str, cache_salt: str | None = None) -> bytes:
    """The 32-byte kvtierd key of SGLang page ``page_hash`` for tenant ``cache_salt``."""
    salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    digest = hashlib.blake2b(digest_size=_KEY_BYTES, person=b"kvtierd-sglang")
    digest.update(_framed(_KEY_DOMAIN) + _framed(salt) + _framed(page_hash.encode()))
    return digest.digest()


def cache_salt_of(extra_info: Any) -> str | None:
    """The tenant's ``cache_salt`` from a ``HiCacheStorageExtraInfo`` (its ``extra_info`` dict),
    or ``None`` where SGLang passed none."""
    extra = getattr(extra_info, "extra_info", None)
    if isinstance(extra, dict):
        salt = extra.get("cache_salt")
        if salt is not None:
            return str(salt)
    return None
