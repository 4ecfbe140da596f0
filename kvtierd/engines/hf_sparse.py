"""Sparse decode on kvtierd: a transformers model decodes over a prompt whose KV lives in
kvtierd, holding only the blocks the daemon's sparse selection names, per layer and KV head.

Theory of operation
-------------------
*Who holds what.* The prompt's full blocks live in kvtierd (a namespace opened with
``sparse=True``, so the daemon summarises each block at COMMIT). The engine keeps the *tail*
densely: the prompt's last, partial block and every generated token (a ``DynamicCache`` that
grows by one token a step). Of the stored blocks it holds only those the current selection
names, in a local pool of whole blocks (``[layers, 2, kv_heads, block_tokens, head_dim]`` each,
the namespace layout), so the memory it needs follows the budget, not the context.

*One step.* The attention of layer ``l`` for the one new token reads, for each KV head ``h``,
the ``budget`` blocks the selection names for ``(l, h)`` (the sink and the newest block are
among them: the daemon forces both) followed by the tail, in one SDPA call with the query heads
packed onto their KV head (:mod:`kvtierd.engines.hf_attention`). After the forward the step's
post-RoPE queries (which the attention saw) go to the daemon in one HINT
(:meth:`~kvtierd.client.Namespace.hint_selection`): the daemon ranks the chain's blocks for
them, answers the selection per layer and KV head, and starts promoting the chosen and the
predicted blocks from NVMe. The selection of step ``t``'s queries serves step ``t + 1``
(consecutive decode steps attend to mostly the same blocks: ``docs/slsap-sparse.md``, lead
time), and the blocks it names that the pool lacks are read (READ, verified copies) before
the step returns: the daemon has had them on their way since the HINT.

*Misses.* A block the step's selection names that the pool still lacks when the step starts
(the HINT or the read after it failed, counted in :attr:`SparseStats.failed_selections`, or the
pool was emptied) is read then, synchronously, and counted in :attr:`SparseStats.misses`;
nothing is skipped. A block gone from every tier fails that step, before its forward. Time
spent reading blocks is :attr:`SparseStats.fetch_s` (after the HINT) and
:attr:`SparseStats.miss_s` (at step start): both are time the engine waits, the *stall*.

*Granularity.* A block holds every layer, so serving one (layer, head)'s choice moves all of
its layers: :attr:`SparseStats.bytes_read` counts what moved, :attr:`SparseStats.bytes_needed`
what reads of single (layer, head) slices would have moved; their ratio is the read
amplification this layout costs.

*The first step* is served by the selection for the last prompt token's queries, captured
while the prompt is computed (the prefill's attention is transformers' own ``sdpa``, unchanged:
only the last query row is copied).

Supported models: those of :class:`~kvtierd.engines.hf.HfKvAdapter` (full-attention decoders,
batch size 1) on ``"sdpa"`` attention, on CPU: the pool, the gather and the queries sent with
HINT live in host memory (a CUDA model is refused; its pool belongs in GPU memory, next).
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvtierd.engines.hf import HfKvAdapter, UnsupportedModelError
from kvtierd.engines.hf_attention import packed_one_token, register_attention
from kvtierd.errors import KvtierError

__all__ = ["SPARSE_SDPA", "SparseDecoder", "SparseStats"]

log = logging.getLogger("kvtierd.engines")

#: The attention implementation the decoder switches its model to while it runs.
SPARSE_SDPA = "kvtierd_sparse_sdpa"

#: Bytes of blocks read per READ: leases within what the daemon lets one connection pin
#: (``limits.connection_pinned_share`` of a small DRAM region), released before the next.
_READ_BYTES = 8 << 20

#: The decoder whose step or prefill is running in this context (None: stock ``sdpa``).
_ACTIVE: contextvars.ContextVar[SparseDecoder | None] = contextvars.ContextVar(
    "kvtierd_sparse_decoder", default=None
)


@dataclass
class SparseStats:
    """What a :class:`SparseDecoder` did so far. Times in seconds, sizes in bytes."""

    steps: int = 0
    #: Forwards of one token (the attention over the selection included).
    forward_s: float = 0.0
    #: HINT round trips: the daemon's ranking of the chain for the step's queries.
    hint_s: float = 0.0
    #: Reading the next step's blocks the pool lacked, after each HINT.
    fetch_s: float = 0.0
    #: Reading, at a step's start, selected blocks the pool still lacked (misses).
    miss_s: float = 0.0
    misses: int = 0
    blocks_read: int = 0
    bytes_read: int = 0
    #: Bytes of the (layer, KV head) slices each new selection named that the one before did
    #: not: what reads per slice would have moved; ``bytes_read`` over it is the amplification
    #: of reading whole blocks.
    bytes_needed: int = 0
    #: Selections the daemon could not make (no summary of any block yet: a restarted daemon
    #: summarises the chain again as it promotes it), the previous one kept instead.
    stale_selections: int = 0
    #: Steps whose HINT or reads after the forward failed (the daemon gone, a block lost):
    #: the step's logits stand, the next step reads what its selection lacks, as misses.
    failed_selections: int = 0
    #: The most blocks the pool held at once.
    peak_blocks: int = 0

    @property
    def stall_s(self) -> float:
        """Time the engine waited for blocks."""
        return self.fetch_s + self.miss_s


class SparseDecoder:
    """Step-by-step sparse decode of one sequence through ``adapter``.

    ``budget_blocks``: blocks per (layer, KV head), sink and newest block included; every
    layer is sparse (a dense layer beside sparse ones would make the pool hold every block).
    ``session`` names the sequence's index in the daemon. ``pool_blocks``: the most blocks the
    pool keeps (default: only those the current selection names); blocks the selection no
    longer names stay until room is needed, least recently selected first, so that one that
    comes back is not read again. ``shared``: every layer and KV head attends to the same
    ``budget_blocks`` blocks, the best of the daemon's ranking of the union (the blocks most
    groups chose first), so that the pool holds ``budget_blocks`` whole blocks and each block
    read serves every layer (no read amplification); by default each (layer, KV head) attends
    to its own choice, whose union over the groups is most of a short context's blocks. Not
    thread-safe, like the model.
    """

    def __init__(
        self,
        adapter: HfKvAdapter,
        *,
        budget_blocks: int,
        session: bytes = b"sparse-decode",
        pool_blocks: int | None = None,
        shared: bool = False,
    ) -> None:
        if adapter.device.type != "cpu":
            raise UnsupportedModelError(f"sparse decode runs on CPU models, not {adapter.device}")
        current = getattr(adapter.model.config, "_attn_implementation", None)
        if current not in ("sdpa", SPARSE_SDPA):
            raise UnsupportedModelError(f"sparse decode needs sdpa attention, not {current!r}")
        if budget_blocks < 1:
            raise ValueError(f"budget_blocks must be at least 1, not {budget_blocks}")
        layout = adapter.layout
        self.adapter = adapter
        self.budget_blocks = budget_blocks
        self.query_layers = list(range(layout.layers))
        self.session = session
        self.pool_blocks = pool_blocks
        self.shared = shared
        self._promote_blocks = budget_blocks + -(-budget_blocks // 4) if shared else 0
        self.stats = SparseStats()
        self._block_shape = (
            layout.layers,
            2,
            layout.kv_heads,
            layout.block_tokens,
            layout.head_dim,
        )
        self._block_bytes = adapter.namespace.block_bytes
        self._slice_bytes = self._block_bytes // (layout.layers * layout.kv_heads)
        self._chain: list[bytes] = []
        self._position_of: dict[bytes, int] = {}
        self._tail: DynamicCache | None = None
        self._position = 0
        self._pool = torch.empty((0, *self._block_shape), dtype=adapter.dtype)
        self._slot_of: dict[int, int] = {}
        #: Per layer: pool slots ``[kv_heads, budget]`` of the selection, and its padding mask.
        self._gather: list[torch.Tensor] = []
        self._pads: list[torch.Tensor | None] = []
        self._selection: np.ndarray | None = None  # [layers, kv_heads, budget] chain positions
        self._queries: dict[int, torch.Tensor] = {}
        self._capture_only = False

    # -- the sequence ------------------------------------------------------------------------

    @property
    def chain(self) -> list[bytes]:
        """The keys of the prompt's full blocks, which kvtierd holds."""
        return list(self._chain)

    @property
    def held_blocks(self) -> int:
        """Blocks the pool holds now."""
        return len(self._slot_of)

    def drop_pool(self) -> None:
        """Let every block of the pool go (the next step reads its selection again, as
        misses): what an engine whose memory was taken for other sequences meets. Reads per
        slice would read the whole selection again too (:attr:`SparseStats.bytes_needed`)."""
        self._slot_of.clear()
        if self._selection is not None:
            self._count_needed(self._selection, None)

    def start(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Compute (or restore) the prompt through the adapter, store its full blocks, keep its
        tail, and select the first step's blocks; returns the last prompt token's logits."""
        ids = [int(t) for t in token_ids]
        adapter = self.adapter
        bt = adapter.block_tokens
        # a new sequence: nothing of the last one's pool, selection or queries stands (the
        # pool's blocks are named by chain position)
        self._slot_of.clear()
        self._selection = None
        self._queries.clear()
        with self._active(capture_only=True):
            result = adapter.prefill(ids, store=True)
        full = len(ids) // bt
        if full * bt == len(ids):  # the newest block stays the engine's: a tail of >= 1 token
            full -= 1
        if full < 1:
            raise ValueError(f"a prompt of {len(ids)} tokens holds no full block of {bt} to store")
        self._chain = adapter.keys(ids)[:full]
        self._position_of = {key: position for position, key in enumerate(self._chain)}
        self._tail = _tail_of(result.cache, full * bt)
        adapter.recycle(result.cache)
        self._position = len(ids)
        self._select()
        return result.logits

    def step(self, token_id: int) -> torch.Tensor:
        """Forward ``token_id`` at the next position; its logits (``[vocab]``)."""
        if self._tail is None or self._selection is None:
            raise RuntimeError("start() the sequence first")
        self._fetch(self._selection, at_step=True)
        self._prepare_gather()
        t0 = time.perf_counter()
        position = torch.tensor([[self._position]], device=self.adapter.device)
        with self._active(capture_only=False), torch.no_grad():
            out = self.adapter.model(
                input_ids=torch.tensor([[int(token_id)]], device=self.adapter.device),
                past_key_values=self._tail,
                position_ids=position,
                cache_position=position[0],
                use_cache=True,
            )
        self.stats.forward_s += time.perf_counter() - t0
        self.stats.steps += 1
        self._position += 1
        try:
            self._select()
        except KvtierError as exc:  # the token is in: its logits stand, the selection stays
            self.stats.failed_selections += 1
            log.warning("sparse decode: the next step's selection failed, kept: %s", exc)
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    def generate(self, token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy decode of up to ``max_new_tokens`` after the prompt ``token_ids``."""
        logits = self.start(token_ids)
        eos = getattr(self.adapter.model.config, "eos_token_id", None)
        stop = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        out: list[int] = []
        while len(out) < max_new_tokens:
            token = int(torch.argmax(logits))
            out.append(token)
            if token in stop or len(out) == max_new_tokens:
                break
            logits = self.step(token)
        return out

    # -- selection and the pool --------------------------------------------------------------

    def _select(self) -> None:
        """HINT the daemon with the queries the last forward saw; read what the pool lacks."""
        queries = np.stack([self._queries[layer].numpy() for layer in self.query_layers])
        t0 = time.perf_counter()
        hint = self.adapter.namespace.hint_selection(
            self._chain,
            queries,
            query_layers=self.query_layers,
            budget_blocks=self.budget_blocks,
            session=self.session,
            # shared, the engine reads the ranking's best only: promote those and a reserve
            promote_blocks=self._promote_blocks,
        )
        self.stats.hint_s += time.perf_counter() - t0
        selected = hint.selected
        if selected.size and (selected < 0).all(axis=2).any():
            # a group with nothing at all: the daemon lost the summaries (a restart)
            if self._selection is not None:
                self.stats.stale_selections += 1
                return
            raise RuntimeError("the daemon selected no block: are the prompt's blocks stored?")
        if self.shared:  # the union's best blocks, most selected first, for every group
            chosen = [self._position_of[key] for key in hint.ranked[: selected.shape[2]]]
            row = np.full(selected.shape[2], -1, np.int32)
            row[: len(chosen)] = chosen
            selected = np.broadcast_to(row, selected.shape).copy()
        # In sequence order (pads last): at a budget of every block the attention reads the
        # keys in the order full attention does, so only the selection differs from it.
        ordered = np.sort(np.where(selected < 0, np.iinfo(np.int32).max, selected), axis=2)
        selected = np.where(ordered == np.iinfo(np.int32).max, -1, ordered).astype(np.int32)
        self._fetch(selected, at_step=False)  # a failure keeps the selection there was
        self._count_needed(selected, self._selection)
        self._selection = selected

    def _count_needed(self, selected: np.ndarray, before: np.ndarray | None) -> None:
        """Add to :attr:`SparseStats.bytes_needed` the (layer, KV head) slices ``selected``
        names that ``before`` does not: what a read per slice would move."""
        layers, kv_heads, _ = selected.shape
        group = np.arange(layers * kv_heads, dtype=np.int64).reshape(layers, kv_heads, 1)
        new = set((group * (1 << 32) + selected)[selected >= 0].tolist())
        if before is not None:
            new -= set((group * (1 << 32) + before)[before >= 0].tolist())
        self.stats.bytes_needed += len(new) * self._slice_bytes

    def _fetch(self, selection: np.ndarray, *, at_step: bool) -> None:
        """Have every block ``selection`` names in the pool, dropping the others."""
        wanted = {int(p) for p in np.unique(selection) if p >= 0}
        held = self._slot_of
        for position in wanted & held.keys():  # most recently selected last
            held[position] = held.pop(position)
        room = max(len(wanted), self.pool_blocks or 0)
        lacking = sorted(wanted - held.keys())
        unselected = [p for p in held if p not in wanted]
        for position in unselected[: max(0, len(held) + len(lacking) - room)]:
            del held[position]
        if not lacking:
            return
        t0 = time.perf_counter()
        self._make_room(len(held) + len(lacking))
        free = sorted(set(range(self._pool.shape[0])) - set(self._slot_of.values()))
        slots = free[: len(lacking)]
        buffers = [self._pool[slot].view(torch.uint8).numpy().reshape(-1) for slot in slots]
        keys = [self._chain[p] for p in lacking]
        step = max(1, _READ_BYTES // self._block_bytes)  # a lease the daemon lets one hold
        for first in range(0, len(keys), step):
            self.adapter.namespace.read_into(
                keys[first : first + step], buffers[first : first + step]
            )
        for position, slot in zip(lacking, slots, strict=True):
            self._slot_of[position] = slot
        elapsed = time.perf_counter() - t0
        stats = self.stats
        stats.blocks_read += len(lacking)
        stats.bytes_read += len(lacking) * self._block_bytes
        stats.peak_blocks = max(stats.peak_blocks, len(self._slot_of))
        if at_step:
            stats.misses += len(lacking)
            stats.miss_s += elapsed
        else:
            stats.fetch_s += elapsed

    def _make_room(self, blocks: int) -> None:
        """Grow the pool to hold ``blocks`` (blocks already held keep their slots)."""
        have = self._pool.shape[0]
        if have >= blocks:
            return
        grown = torch.empty((max(blocks, 2 * have), *self._block_shape), dtype=self._pool.dtype)
        grown[:have] = self._pool
        self._pool = grown

    def _prepare_gather(self) -> None:
        """The pool slots each layer's attention reads this step, per KV head."""
        assert self._selection is not None
        selection = self._selection
        lookup = np.zeros(len(self._chain), np.int64)  # chain position -> pool slot
        lookup[list(self._slot_of)] = list(self._slot_of.values())
        pads = selection < 0
        slots = lookup[np.where(pads, 0, selection)]  # a pad reads slot 0, masked out
        bt = self.adapter.block_tokens
        self._gather = [torch.from_numpy(slots[i]) for i in range(len(self.query_layers))]
        self._pads = [
            torch.from_numpy(np.repeat(pads[i], bt, axis=1)) if pads[i].any() else None
            for i in range(len(self.query_layers))
        ]

    # -- attention ---------------------------------------------------------------------------

    @contextmanager
    def _active(self, *, capture_only: bool) -> Iterator[None]:
        model = self.adapter.model
        before = model.config._attn_implementation
        register_attention(SPARSE_SDPA, sparse_sdpa)
        if before != SPARSE_SDPA:
            model.set_attn_implementation(SPARSE_SDPA)
        self._capture_only = capture_only
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            if before != SPARSE_SDPA:
                model.set_attn_implementation(before)

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
    ) -> torch.Tensor:
        """One new token's attention at ``module``'s layer over the selected blocks and the
        tail (``key``/``value``: the tail, this token included, as the cache returned them)."""
        layer = int(module.layer_idx)  # type: ignore[arg-type]
        dim = query.shape[3]
        self._queries[layer] = query[0, :, -1].float()
        slots = self._gather[layer]  # [kv_heads, budget]
        kv_heads = slots.shape[0]
        heads_index = torch.arange(kv_heads).unsqueeze(1)
        planes = self._pool[:, layer]  # [pool, 2, kv_heads, bt, head_dim]
        picked_k = planes[:, 0][slots, heads_index].reshape(1, kv_heads, -1, dim)
        picked_v = planes[:, 1][slots, heads_index].reshape(1, kv_heads, -1, dim)
        keys = torch.cat([picked_k, key], dim=2)
        values = torch.cat([picked_v, value], dim=2)
        mask = None
        pads = self._pads[layer]
        if pads is not None:
            keep = torch.cat([~pads, torch.ones(kv_heads, key.shape[2], dtype=torch.bool)], 1)
            mask = keep.reshape(1, kv_heads, 1, -1)
        return packed_one_token(query, keys, values, scaling, mask)


def sparse_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention a :class:`SparseDecoder` runs its model on: its one-token steps attend
    over the selection; everything else (its prefill, any other forward) is transformers'
    ``sdpa``, with the prefill's last query row copied for the first selection."""
    decoder = _ACTIVE.get()
    if decoder is not None and not decoder._capture_only and query.shape[2] == 1:
        return decoder.attend(module, query, key, value, scaling), None
    if decoder is not None:
        decoder._queries[int(module.layer_idx)] = query[0, :, -1].float()  # type: ignore[arg-type]
    out, _ = sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )
    return out, None


def _tail_of(cache: DynamicCache, start: int) -> DynamicCache:
    """A new cache holding the tokens ``start..`` of ``cache`` (copies: ``cache`` is recycled)."""
    tail = DynamicCache()
    layers: list[Any] = list(cache.layers)
    for index, layer in enumerate(layers):
        keys = layer.keys[:, :, start:].clone()
        values = layer.values[:, :, start:].clone()
        tail.update(keys, values, index)
    return tail
