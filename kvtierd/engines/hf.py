"""Hugging Face transformers on kvtierd: restore a prompt's cached prefix into the model's KV
cache, prefill only the uncached suffix, store the new full blocks.

Theory of operation
-------------------
*Block layout.* A block holds the K and V of ``block_tokens`` consecutive tokens for every
layer, layer-major: for layer ``0 .. L-1``, K then V, each ``[kv_heads, block_tokens,
head_dim]`` C-contiguous, in the model's own dtype. So a block is a C-contiguous
``[L, 2, kv_heads, block_tokens, head_dim]`` array (``kvtierd.slsap`` reads exactly this).
The namespace records model id, dtype and that layout (:func:`model_layout`); the daemon refuses
a ``block_bytes`` that disagrees with it, and this adapter refuses a namespace whose layout is not
its model's (:class:`LayoutMismatchError`), so no block is ever read under another layout.

*Keys.* :func:`kvtierd.keys.chain_keys` over the token ids with the namespace's salt: key ``i``
names the tokens ``[0, (i + 1) * block_tokens)``. Only full blocks get keys.

*Restore: one copy, into memory prepared beforehand.* READ leases the blocks in the daemon's
arena, which this process already maps, and each block is copied into the prompt's
:class:`~kvtierd.engines.hf_cache.KvSlab` (a ``[2L, kv_heads, capacity, head_dim]`` tensor)
with its checksum taken in the same pass: one native call a block into its 2L x kv_heads
runs of the slab (:func:`~kvtierd.engines.hf_cache.copy_verified_blocks`). A GPU slab, and a
last block the slab cannot hold whole, are hashed in the lease first and then copied by torch:
the adapter views the mapping once as a tensor, and each leased extent (runs of adjacent
extents coalesced) as ``[blocks, 2L, kv_heads, block_tokens, head_dim]``, all layers at once.
The slab is allocated and pre-faulted ahead (:meth:`HfKvAdapter.reserve`,
:meth:`HfKvAdapter.recycle`), and the cache's :class:`~kvtierd.engines.hf_cache.SlabLayer`
layers view its planes. The forward over the uncached suffix then writes its new states in
place: no ``torch.cat``, no fresh memory (on the shared machines here copying 188 MB into
fresh memory took 0.23-0.29 s under load, into pre-faulted memory 0.05 s). Each lease is
released as soon as its blocks are copied, before the forward.

*On a GPU* (a model moved to CUDA) the slab is allocated on the model's device and each run is
delivered by :func:`kvtierd.client.cuda.deliver` from the arena mapping, registered once as
pinned memory, layer by layer on a stream of its own; the model's stream waits for the last
layer and the lease is released once the copies are done.

*Reads overlap the copy.* When some hits are below DRAM, LOOKUP has started promoting all of
them, and the adapter READs in batches of ``_READ_BATCH_BLOCKS``: while it copies one batch the
daemon keeps reading the next ones from disk.

*One-token attention* (opt-in, ``packed_decode_attention=True``): a model on ``"sdpa"``
attention is switched to :mod:`kvtierd.engines.hf_attention`, whose one-token forwards pack each
KV head's query heads into one SDPA call (transformers' own ``pack_gqa``), several times faster
on CPU than SDPA's ``enable_gqa``; prompts are computed as before. Off by default: its rounding
differs from stock attention, and a library must not change its caller's model numerics
unasked.

*At least one token is forwarded.* The first generated token needs the logits of the prompt's
last token, so at most ``len(prompt) - 1`` tokens are restored; when every block of the prompt
is cached, the last token's K/V is left out of the restore and recomputed.

*Missing blocks.* LOOKUP answers how many *leading* keys are present, so a block missing in the
middle of the prefix ends the hit there (a shorter hit, never an error). A block can also vanish
between LOOKUP and READ (evicted, forgotten, or torn on disk and so refused by the daemon): READ
then fails with :class:`~kvtierd.errors.BlockNotFoundError`: the blocks copied so far stay, and
the adapter looks up the rest again, a bounded number of times; what is not restored is
computed.

*Store.* After the forward the full blocks that were not restored are gathered from the cache
into layer-major buffers and PUT (two-phase: ALLOC, copy, COMMIT); blocks already stored are
skipped by the daemon.

*Dtype.* Blocks are moved bit for bit in the model's dtype (bf16 as a raw byte view: numpy has
no bfloat16); nothing is ever cast. A cache whose tensors are not in the namespace's dtype is
refused.

Supported models: decoder-only causal LMs whose every layer is full attention with
``DynamicCache`` layers (Llama, Mistral without sliding window, Qwen2, SmolLM2, ...); batch size 1.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from kvtierd.client import BlockNotFoundError, Client, Layout, Namespace, chain_keys, ops
from kvtierd.client.arena import verified_prefix
from kvtierd.client.cuda import PinnedRegion, deliver
from kvtierd.engines.hf_attention import use_packed_decode_attention
from kvtierd.engines.hf_cache import (
    BlockRun,
    KvSlab,
    copy_run,
    copy_verified_blocks,
    gather_blocks,
    slab_cache,
)
from kvtierd.errors import KvtierError
from kvtierd.layouts import layout_block_bytes
from kvtierd.protocol.messages import Extent

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "HfKvAdapter",
    "LayoutMismatchError",
    "PrefillResult",
    "UnsupportedModelError",
    "model_layout",
]

#: Tokens per block: 64 tokens of SmolLM2-135M are 1.4 MiB in bf16, a size the disk reads at
#: full speed, and at most 63 trailing prompt tokens are left uncached.
DEFAULT_BLOCK_TOKENS = 64
#: How many times a prefix whose block vanished after LOOKUP is looked up again.
_READ_ATTEMPTS = 3
#: Blocks per READ when some come from below DRAM: LOOKUP has started promoting every hit, and
#: the copy of one batch into the cache overlaps the disk reads of the next ones.
_READ_BATCH_BLOCKS = 16
#: Tokens a prefill's cache holds beyond the prompt before a layer must move (decode steps).
DEFAULT_HEADROOM_TOKENS = 256
#: Blocks gathered per PUT: bounds the store buffer (64 MiB for SmolLM2 in fp32).
_STORE_CHUNK_BLOCKS = 16

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class LayoutMismatchError(KvtierError, ValueError):
    """A namespace's layout (or a cache's tensors) does not match the model's KV layout."""


class UnsupportedModelError(KvtierError, TypeError):
    """The model's cache is not one this adapter can fill (sliding window, linear attention)."""


def model_layout(model: Any, *, model_id: str, block_tokens: int) -> Layout:
    """The namespace layout of ``model``'s KV cache.

    Args:
        model: a transformers causal LM (its ``config`` and ``dtype`` are read).
        model_id: names the weights; blocks are shared only between equal ids, so include
            anything that changes the KV (quantisation, fine-tune, revision).
        block_tokens: tokens per block.

    Raises:
        UnsupportedModelError: a layer is not full attention, or the dtype has no name here.
    """
    cfg = model.config.get_text_config(decoder=True)
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise UnsupportedModelError(f"only full-attention layers are supported, got {layer_types}")
    dtype = model.dtype
    if dtype not in _DTYPE_NAMES:
        raise UnsupportedModelError(f"no kvtierd dtype name for {dtype}")
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    return Layout(
        model_id, int(cfg.num_hidden_layers), kv_heads, head_dim, _DTYPE_NAMES[dtype], block_tokens
    )


@dataclass(frozen=True)
class PrefillResult:
    """What :meth:`HfKvAdapter.prefill` did.

    ``logits`` are the last prompt token's logits (``[vocab]``, the model's dtype): the first
    generated token's distribution. ``cache`` holds the K/V of every prompt token. Times are
    seconds from the call: ``ttft_s`` until the logits existed, and its parts.
    """

    logits: torch.Tensor
    cache: DynamicCache
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    hit_blocks: int
    blocks_by_tier: dict[str, int]
    stored_blocks: int
    lookup_s: float
    read_s: float
    forward_s: float
    ttft_s: float
    store_s: float = 0.0
    retries: int = 0


@dataclass
class _Restored:
    """The restored prefix of one prefill: ``hits`` blocks, ``tokens`` tokens."""

    hits: int = 0
    tokens: int = 0
    tiers: list[str] = field(default_factory=list)
    lookup_s: float = 0.0
    read_s: float = 0.0
    retries: int = 0


class HfKvAdapter:
    """Prefix caching for one transformers causal LM through one kvtierd namespace.

    Not thread-safe: one adapter serves one sequence at a time (like the model it wraps).
    """

    def __init__(
        self,
        model: Any,
        namespace: Namespace,
        *,
        model_id: str,
        packed_decode_attention: bool = False,
    ) -> None:
        """Use ``namespace`` for ``model``'s blocks.

        With ``packed_decode_attention`` (off by default) a model on ``"sdpa"`` attention is
        switched to :func:`~kvtierd.engines.hf_attention.packed_decode_sdpa` (one-token forwards
        several times faster on CPU, prompts unchanged, decode rounding not stock's).

        Raises:
            LayoutMismatchError: the namespace declares no layout, or one that is not this
                model's (layers, KV heads, head dim, dtype, model id, order) or its block size
                disagrees.
            UnsupportedModelError: see :func:`model_layout`.
        """
        declared = namespace.handle.layout
        if declared is None:
            raise LayoutMismatchError("the namespace declares no layout; open it with one")
        expected = model_layout(model, model_id=model_id, block_tokens=declared.block_tokens)
        if declared != expected:
            raise LayoutMismatchError(f"namespace layout {declared} is not the model's {expected}")
        if namespace.block_bytes != layout_block_bytes(expected):
            raise LayoutMismatchError(
                f"namespace blocks are {namespace.block_bytes} bytes, the model's "
                f"{layout_block_bytes(expected)}"
            )
        if packed_decode_attention:
            use_packed_decode_attention(model)
        self.model = model
        self.namespace = namespace
        self.layout = expected
        self.dtype: torch.dtype = model.dtype
        #: Where the model, and so its KV cache, lives: restores copy straight there.
        self.device = torch.device(getattr(model, "device", "cpu"))
        self.headroom_tokens = DEFAULT_HEADROOM_TOKENS
        self._arena: torch.Tensor | None = None
        self._arena_reconnects = 0
        #: The arena mapping registered as pinned memory, for restores into GPU memory.
        self._pinned: PinnedRegion | None = None
        self._spare: KvSlab | None = None
        self._store_buffer: torch.Tensor | None = None

    @classmethod
    def open(
        cls,
        client: Client,
        model: Any,
        *,
        model_id: str,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        tenant: str = "default",
        packed_decode_attention: bool = False,
        sparse: bool = False,
    ) -> HfKvAdapter:
        """Open (creating if needed) ``model``'s namespace, named after ``model_id``; with
        ``sparse`` the daemon summarises its blocks for sparse decode
        (:mod:`kvtierd.engines.hf_sparse`)."""
        layout = model_layout(model, model_id=model_id, block_tokens=block_tokens)
        namespace = client.namespace(
            f"hf/{model_id}"[:255], layout=layout, tenant=tenant, sparse=sparse
        )
        return cls(
            model, namespace, model_id=model_id, packed_decode_attention=packed_decode_attention
        )

    @property
    def block_tokens(self) -> int:
        return int(self.layout.block_tokens)

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chained key of every full block of ``token_ids``."""
        return chain_keys(token_ids, self.block_tokens, self.namespace.key_salt)

    def lookup(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` are cached (a multiple of the block size);
        starts promoting them into DRAM."""
        return self.namespace.lookup(self.keys(token_ids)) * self.block_tokens

    # -- slabs ------------------------------------------------------------------------------

    def reserve(self, tokens: int) -> None:
        """Prepare (allocate and pre-fault) the K/V memory of a prompt of up to ``tokens``
        tokens now, so that the next :meth:`prefill` does not pay for first-touching it. What
        an engine does once at start-up with its KV pool; :meth:`recycle` keeps it going."""
        capacity = tokens + self.headroom_tokens
        if self._spare is None or self._spare.capacity < capacity:
            self._spare = None  # free the smaller one first
            self._spare = self._new_slab(capacity)

    def recycle(self, cache: DynamicCache) -> None:
        """Give ``cache``'s memory back for the next :meth:`prefill` (the caller is done with
        it: it is overwritten). A cache that is not one of this adapter's is ignored."""
        slab = getattr(cache, "kvtierd_slab", None)
        layout = self.layout
        if not isinstance(slab, KvSlab) or not slab.fits(
            layout.layers, layout.kv_heads, layout.head_dim, self.dtype, self.device
        ):
            return
        if self._spare is None or self._spare.capacity < slab.capacity:
            self._spare = slab
        cache.layers = []

    def _new_slab(self, capacity: int) -> KvSlab:
        layout = self.layout
        return KvSlab(
            layout.layers, layout.kv_heads, layout.head_dim, capacity, self.dtype, self.device
        )

    def _take_slab(self, tokens: int) -> KvSlab:
        spare = self._spare
        if spare is not None and spare.capacity >= tokens:
            self._spare = None
            return spare
        return self._new_slab(tokens + self.headroom_tokens)

    # -- prefill -----------------------------------------------------------------------------

    def prefill(self, token_ids: Sequence[int], *, store: bool = True) -> PrefillResult:
        """Restore the cached prefix of ``token_ids``, forward the rest, optionally store.

        Returns the last token's logits and a cache holding every prompt token (see
        :class:`PrefillResult`); storing happens after the logits exist, so it is not part
        of ``ttft_s``.

        Raises:
            ValueError: ``token_ids`` is empty.
            KvtierError: the daemon failed otherwise than with a vanished block.
        """
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("a prompt has at least one token")
        started = time.perf_counter()
        usable = self.keys(ids)[: -(-(len(ids) - 1) // self.block_tokens)]
        slab = self._take_slab(len(ids))
        restored = self._restore(usable, slab.planes, len(ids) - 1)
        cached = restored.tokens
        cache = slab_cache(self.model.config, slab, cached)
        t0 = time.perf_counter()
        logits = self.forward(ids[cached:], cache)
        forward_s = time.perf_counter() - t0
        ttft_s = time.perf_counter() - started
        by_tier: dict[str, int] = {}
        for tier in restored.tiers:
            by_tier[tier] = by_tier.get(tier, 0) + 1
        stored, store_s = 0, 0.0
        if store:
            t1 = time.perf_counter()
            stored = self.store(ids, cache, first_block=restored.hits)
            store_s = time.perf_counter() - t1
        return PrefillResult(
            logits=logits,
            cache=cache,
            prompt_tokens=len(ids),
            cached_tokens=cached,
            computed_tokens=len(ids) - cached,
            hit_blocks=restored.hits,
            blocks_by_tier=by_tier,
            stored_blocks=stored,
            lookup_s=restored.lookup_s,
            read_s=restored.read_s,
            forward_s=forward_s,
            ttft_s=ttft_s,
            store_s=store_s,
            retries=restored.retries,
        )

    def _restore(self, keys: Sequence[bytes], planes: torch.Tensor, limit: int) -> _Restored:
        """LOOKUP ``keys``, then READ the hit prefix in order and copy it into ``planes`` (at
        most ``limit`` tokens), releasing each lease as soon as its blocks are copied.

        Blocks all in DRAM are read with one READ. Otherwise LOOKUP has started promoting every
        hit, and READs of ``_READ_BATCH_BLOCKS`` blocks let the copy of one batch overlap the
        disk reads of the next. A block that vanished after LOOKUP fails its READ: the blocks
        copied so far stay, the rest is looked up again (``_READ_ATTEMPTS`` times in all).
        """
        client = self.namespace.client
        ns = self.namespace.handle.ns
        restored = _Restored()
        done = 0
        for attempt in range(_READ_ATTEMPTS):
            if done >= len(keys):
                break
            t0 = time.perf_counter()
            tiers = self.namespace.lookup_tiers(keys[done:])
            t1 = time.perf_counter()
            restored.lookup_s += t1 - t0
            if not tiers:
                break
            restored.tiers = restored.tiers[:done] + tiers
            total = done + len(tiers)
            batch = len(tiers) if all(t == "dram" for t in tiers) else _READ_BATCH_BLOCKS
            failed = False
            try:
                while done < total:
                    stop = min(done + batch, total)
                    try:
                        leases, extents = client.run(ops.read(ns, keys[done:stop], client.max_keys))
                    except BlockNotFoundError:
                        failed = True
                        break
                    try:
                        good = self._copy_verified_in(planes, extents, done, limit)
                    finally:
                        client.run(ops.release(leases))
                    if good < len(extents):  # changed after COMMIT: a miss from there on
                        client.corrupt_reads += 1
                        done += good
                        break
                    done = stop
            finally:
                restored.read_s += time.perf_counter() - t1
            if not failed:
                break
            restored.retries = attempt + 1
        restored.hits = done
        restored.tiers = restored.tiers[:done]
        restored.tokens = min(done * self.block_tokens, limit)
        return restored

    def _copy_verified_in(
        self, planes: torch.Tensor, extents: Sequence[Extent], first_block: int, limit: int
    ) -> int:
        """Copy the leased blocks ``first_block ..`` into ``planes`` (tokens below ``limit``)
        and check every block against its checksum; returns how many leading blocks passed (a
        block changed after COMMIT and those after it are a miss: the forward recomputes their
        tokens over whatever the slab holds there). Host planes:
        each whole block hashed in the pass that copies it into its 2L x kv_heads runs (2.1x
        the speed of the hash plus torch's strided copy, ``tools/bench_engine_copies.py``);
        a GPU's copy is DMA, which nothing can hash as it goes, so there, and for a last block
        the slab cannot hold whole, the lease is hashed first."""
        if any(e.length != self.namespace.block_bytes for e in extents):
            raise LayoutMismatchError("the daemon served a block of another size")
        arena = self.namespace.arena
        views = [arena.view(e.offset, e.length) for e in extents]
        copied = 0
        if planes.device.type == "cpu":
            sums = [e.checksum for e in extents]
            copied, failed = copy_verified_blocks(
                planes, views, sums, first_block, self.block_tokens, limit
            )
            if failed:
                return copied
        good = copied + verified_prefix(views[copied:], list(extents[copied:]))
        self._copy_in(planes, extents[copied:good], first_block + copied, limit)
        return good

    def _copy_in(
        self, planes: torch.Tensor, extents: Sequence[Extent], first_block: int, limit: int
    ) -> None:
        """Copy the leased blocks ``first_block ..`` (``extents``) into ``planes``, tokens
        below ``limit`` only: one strided copy per run of blocks adjacent in the arena."""
        layout = self.layout
        bt, block_bytes = self.block_tokens, self.namespace.block_bytes
        shape = (2 * layout.layers, layout.kv_heads, bt, layout.head_dim)
        arena = self._arena_tensor()
        needed = min(len(extents), -(-(limit - first_block * bt) // bt))
        first = 0
        while first < needed:
            last = first + 1
            while last < needed and extents[last].offset == extents[last - 1].offset + block_bytes:
                last += 1
            if any(e.length != block_bytes for e in extents[first:last]):
                raise LayoutMismatchError("the daemon served a block of another size")
            offset, count = extents[first].offset, last - first
            view = arena[offset : offset + count * block_bytes].view(self.dtype).view(count, *shape)
            start = (first_block + first) * bt
            run = BlockRun(start, min(count * bt, limit - start), view)
            if planes.device.type == "cpu":
                copy_run(planes, run, bt)
            else:
                self._deliver_run(planes, run)
            first = last

    def _deliver_run(self, planes: torch.Tensor, run: BlockRun) -> None:
        """``run`` into GPU ``planes`` through :func:`kvtierd.client.cuda.deliver` (DMA from the
        pinned arena, layer by layer on a stream of its own), waited for before it returns: the
        caller releases the lease next. The last block, when only part of it is wanted and the
        slab has no room for all of it, goes through a plain copy."""
        bt = self.block_tokens
        whole = run.tokens // bt
        if run.tokens % bt and run.start + (whole + 1) * bt <= planes.shape[2]:
            whole += 1  # the extra tokens land beyond the cache's length, unread
        if whole:
            self._pin_arena()
            with deliver(list(run.view[:whole]), planes, run.start) as delivery:
                delivery.wait(delivery.layers - 1)  # the engine's stream, for its forward
        if whole * bt < run.tokens:
            rest = BlockRun(run.start + whole * bt, run.tokens - whole * bt, run.view[whole:])
            copy_run(planes, rest, bt)

    def _pin_arena(self) -> None:
        """Register the arena mapping as pinned host memory once (again after a reconnect)."""
        arena = self._arena_tensor()
        if self._pinned is not None and self._pinned.buffer is arena:
            return
        if self._pinned is not None:
            self._pinned.unpin()
        self._pinned = PinnedRegion(arena, self.device)
        self._pinned.pin()

    def forward(self, token_ids: Sequence[int], cache: DynamicCache) -> torch.Tensor:
        """Forward ``token_ids`` onto ``cache`` (which grows by them); the last token's logits
        (``[vocab]``, the model's dtype). The path every prefill takes after its restore."""
        with torch.no_grad():
            out = self.model(
                input_ids=torch.tensor([list(token_ids)], dtype=torch.long, device=self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    def _arena_tensor(self) -> torch.Tensor:
        # A client that reconnected maps the restarted daemon's region: wrap that one.
        reconnects = self.namespace.client.reconnects
        if self._arena is None or self._arena_reconnects != reconnects:
            buffer = self.namespace.arena_buffer()
            with warnings.catch_warnings():
                # The mapping is shared and only ever read through this tensor.
                warnings.filterwarnings("ignore", message=".*not writable.*")
                self._arena = torch.frombuffer(buffer, dtype=torch.uint8)
            self._arena_reconnects = reconnects
        return self._arena

    # -- store -------------------------------------------------------------------------------

    def store(self, token_ids: Sequence[int], cache: DynamicCache, *, first_block: int = 0) -> int:
        """PUT the full blocks ``first_block ..`` of ``token_ids`` that ``cache`` covers.

        Returns how many blocks the daemon holds of those offered (stored now or before).

        Raises:
            LayoutMismatchError: the cache's tensors are not in the namespace's dtype or shape.
            KvtierError: the daemon refused the write (``NoSpaceError`` ...).
        """
        bt = self.block_tokens
        covered = min(len(token_ids), cache.get_seq_length())
        keys = self.keys(list(token_ids)[:covered])
        stored = 0
        for start in range(first_block, len(keys), _STORE_CHUNK_BLOCKS):
            stop = min(start + _STORE_CHUNK_BLOCKS, len(keys))
            buffer = self._gather(cache, start * bt, stop - start)
            blocks = [buffer[i].view(torch.uint8).numpy() for i in range(stop - start)]
            stored += self.namespace.put(keys[start:stop], blocks)
        return stored

    def _gather(self, cache: DynamicCache, start: int, count: int) -> torch.Tensor:
        """Blocks ``[count, 2L, kv_heads, bt, head_dim]`` of the tokens from ``start``, in a
        buffer reused by later calls."""
        layout, bt = self.layout, self.block_tokens
        shape = (count, 2 * layout.layers, layout.kv_heads, bt, layout.head_dim)
        needed = count * 2 * layout.layers * layout.kv_heads * bt * layout.head_dim
        if self._store_buffer is None or self._store_buffer.numel() < needed:
            self._store_buffer = torch.empty(needed, dtype=self.dtype)
        buffer = self._store_buffer[:needed].view(shape)
        try:
            gather_blocks(cache, start, buffer, expected_dtype=self.dtype)
        except ValueError as exc:
            raise LayoutMismatchError(str(exc)) from exc
        return buffer
