"""Sparse-attention retrieval served by the daemon (HINT with query vectors).

For a namespace opened with ``sparse=True`` the daemon summarises every committed block (the
element-wise min, max and mean key per layer and KV head, read straight from the block's arena
slot in a worker thread) and keeps the summaries. A HINT that carries a sequence's key chain and
the current decode step's query vectors is answered from a per-(namespace, session)
:class:`~kvtierd.slsap.sparse.index.SparseIndex`: the blocks of the chain not yet indexed are
added (block id = position in the chain), the index selects the blocks most likely to carry the
attention mass within the budget (attention sink and recent window always in), and the daemon
starts promoting them, then the blocks predicted for the next step. The ranking and the
prediction go back to the engine as keys.

The index is not thread-safe: each session's calls are serialised by a lock, and the CPU work
runs in a worker thread so the event loop keeps serving. An index that outgrows its clusters
(thousands of blocks: k-means takes seconds) is clustered afresh in a background job the store
owns, off the session's lock; until it lands, its HINTs score every block. Sessions beyond
``max_sessions`` are dropped least recently used first, and so are sessions while all indices
together hold more than ``max_index_bytes`` (twice the summaries' bound).

Summaries follow their block: one is dropped when its block leaves the store (its last tier
let it go, or it was forgotten), and together they stay within ``max_summary_bytes`` (the
least recently summarised or used go first; such a block is then simply not ranked).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import numpy as np

from kvtierd.errors import InvalidRequestError
from kvtierd.slsap.sparse import BlockLayout, SparseConfig, SparseIndex, summarize_block
from kvtierd.slsap.sparse.ivf import FitStopped
from kvtierd.store.index import Block
from kvtierd.store.namespaces import Namespace

__all__ = ["SparseRetrieval", "SparseSelection"]

log = logging.getLogger("kvtierd.store")


@dataclass(frozen=True, slots=True)
class SparseSelection:
    """Keys to promote now (ranked) and for the next decode step (predicted, not ranked), and
    the selection they come from: chain positions ``[groups, budget]`` (int32, -1 padded; row
    ``i * kv_heads + h`` is the ``i``-th query layer's KV head ``h``)."""

    ranked: list[bytes]
    predicted: list[bytes]
    selected: np.ndarray
    #: Keys of the chain with no summary yet (a restarted daemon keeps none), to promote so
    #: that they are summarised and ranked at a later HINT; at most :data:`_UNSUMMARISED`.
    unsummarised: list[bytes] = field(default_factory=list)


#: Sparse rankings (index upkeep and selection) running at once in worker threads.
_RANKINGS_AT_ONCE = 2
#: Background fits of indices' clusters at once, apart from the rankings' threads (a fit
#: takes seconds: sharing their slots made other tenants' HINTs wait for whole fits), and at
#: most this many pending (each holds its index's boxes, a dropped session's too, until done).
_FITS_AT_ONCE = 1
#: Unsummarised chain blocks one HINT asks to promote (a READ's worth of a long chain), and
#: at most half of what the summaries' bound holds.
_UNSUMMARISED = 256


def _summary_bytes(layout: BlockLayout) -> int:
    """Bytes of one block's summary as kept: float16 min, max and mean per layer and KV head."""
    return layout.layers * layout.kv_heads * 3 * layout.head_dim * 2


@dataclass
class _Session:
    index: SparseIndex
    chain: list[bytes] = field(default_factory=list)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    #: Positions of the chain not indexed for want of a summary: looked for again each HINT.
    pending: set[int] = field(default_factory=set)
    #: The index whose clusters are being made in the background, if it is still this
    #: session's (:meth:`SparseRetrieval._fit`; a reset session's new index may start its own).
    fitting: SparseIndex | None = None


class SparseRetrieval:
    """Summaries of sparse namespaces' blocks, and the sessions' indices."""

    def __init__(self, max_sessions: int = 64, max_summary_bytes: int = 256 << 20) -> None:
        self.max_sessions = max_sessions
        self.max_summary_bytes = max_summary_bytes
        #: What the sessions' indices may hold together: each holds at most about 1.7 times
        #: the summaries it indexes (float32 boxes where a summary keeps float16), so this
        #: leaves room for one session indexing every summary and the others beside it;
        #: beyond it the least recently used sessions go (their next HINT starts afresh).
        self.max_index_bytes = 2 * max_summary_bytes
        self._summaries: OrderedDict[tuple[bytes, bytes], np.ndarray] = OrderedDict()
        self._sessions: OrderedDict[tuple[int, bytes], _Session] = OrderedDict()
        self.summary_bytes = 0
        #: Summaries dropped to stay within ``max_summary_bytes``.
        self.summaries_dropped = 0
        #: Sessions' indices dropped to stay within ``max_index_bytes``.
        self.sessions_dropped = 0
        #: Rankings at once: each may build an index of every summary before the sessions
        #: are trimmed, and each holds a worker thread, so a flood of HINTs on many sessions
        #: waits here instead of multiplying memory and threads.
        self._limiter = anyio.CapacityLimiter(_RANKINGS_AT_ONCE)
        #: Starts a background job owned by the store (its task group); ``None``: an index's
        #: clusters are made inside the HINT that outgrew them.
        self.spawn: Callable[[Callable[[], Coroutine[Any, Any, None]]], object] | None = None
        #: Background fits started and not done (at most :data:`_FITS_AT_ONCE`), their cancel
        #: scopes (a closing store cancels them: :meth:`cancel_fits`) and their own limiter.
        self._fits = 0
        self._fit_scopes: set[anyio.CancelScope] = set()
        self._fit_limiter = anyio.CapacityLimiter(_FITS_AT_ONCE)
        self._closing = False
        self._stopping = threading.Event()  # read by the fits' threads

    @property
    def fits(self) -> int:
        """Indices being clustered in the background now."""
        return self._fits

    @property
    def summaries(self) -> int:
        return len(self._summaries)

    @staticmethod
    def layout_of(ns: Namespace) -> BlockLayout:
        layout = ns.spec.layout
        if layout is None:
            raise InvalidRequestError("sparse retrieval needs a namespace with a layout")
        return BlockLayout(
            layout.layers, layout.kv_heads, layout.head_dim, layout.block_tokens, layout.dtype
        )

    async def summarise(
        self,
        ns: Namespace,
        blocks: Sequence[tuple[bytes, memoryview]],
        keep: Callable[[bytes], bool] | None = None,
    ) -> None:
        """Summarise blocks of a sparse namespace: ``(key, arena bytes)``. ``keep``: asked of
        each key once the summaries are made, since the store went on meanwhile (a block
        FORGET dropped while it was summarised gets no summary: it has no block to follow)."""
        layout = self.layout_of(ns)

        def work() -> list[np.ndarray]:
            return [
                summarize_block(view, layout).stacked().astype(np.float16) for _, view in blocks
            ]

        for (key, _), summary in zip(blocks, await anyio.to_thread.run_sync(work), strict=True):
            if keep is not None and not keep(key):
                continue
            self._drop((ns.digest, key))
            self._summaries[(ns.digest, key)] = summary
            self.summary_bytes += summary.nbytes
        while self.summary_bytes > self.max_summary_bytes and self._summaries:
            self._drop(next(iter(self._summaries)))
            self.summaries_dropped += 1

    def summarised(self, block_id: tuple[bytes, bytes]) -> bool:
        """Whether the block ``(namespace digest, key)`` has its summary."""
        return block_id in self._summaries

    def forget(self, block: Block) -> None:
        """``block`` left the store: its summary goes too."""
        self._drop(block.id)

    def _drop(self, block_id: tuple[bytes, bytes]) -> None:
        summary = self._summaries.pop(block_id, None)
        if summary is not None:
            self.summary_bytes -= summary.nbytes

    async def select(
        self,
        ns: Namespace,
        session: bytes,
        chain: Sequence[bytes],
        queries: np.ndarray,
        query_layers: Sequence[int],
        budget_blocks: int,
    ) -> SparseSelection:
        """Rank the chain's blocks for ``queries`` (``[len(query_layers), q_heads, head_dim]``)."""
        if not chain:
            raise InvalidRequestError("a sparse HINT needs the sequence's key chain")
        if len(set(chain)) != len(chain):
            # a sequence's chained keys are distinct; a repeated one would be indexed once per
            # position, past every bound on summaries
            raise InvalidRequestError("a sparse HINT's chain names each block once")
        entry = self._session(ns, session, queries, query_layers)
        async with entry.lock:
            if list(chain[: len(entry.chain)]) != entry.chain:  # another sequence: start over
                entry.index = SparseIndex(entry.index.config)
                entry.chain = []
                entry.pending = set()
            looked_for = sorted(entry.pending) + list(range(len(entry.chain), len(chain)))
            new = [(position, self._used((ns.digest, chain[position]))) for position in looked_for]
            pending = {position for position, summary in new if summary is None}
            # no more than half the summaries' bound holds: a larger batch would push its own
            # first summaries out before any session indexed them
            fits = self.max_summary_bytes // (2 * _summary_bytes(self.layout_of(ns)))
            unsummarised = [chain[p] for p in sorted(pending)[: max(1, min(_UNSUMMARISED, fits))]]

            # No row is longer than the chain: a client's budget beyond it asks for nothing more
            # and must not size the daemon's arrays.
            budget = min(budget_blocks, len(chain))
            groups = len(entry.index.config.layers) * entry.index.config.kv_heads

            def work() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
                known = [(p, s) for p, s in new if s is not None]
                if known:
                    positions = np.asarray([p for p, _ in known], dtype=np.int64)
                    layers = list(entry.index.config.layers)
                    every = layers == list(range(known[0][1].shape[0]))
                    shape = (len(known), len(layers), *known[0][1].shape[1:])
                    boxes = np.empty(shape, np.float32)  # widened in place, no float16 copy
                    for row, (_, summary) in enumerate(known):
                        boxes[row] = summary if every else summary[layers]
                    # with a task group the clusters are made in the background (a fit of
                    # thousands of blocks takes seconds; meanwhile every block is scored)
                    entry.index.insert_many(positions, positions, boxes, fit=self.spawn is None)
                if not len(entry.index):
                    nothing = np.empty(0, np.int64)
                    return nothing, nothing, np.full((groups, budget), -1, np.int32)
                selection = entry.index.select(queries, budget)
                return (
                    selection.blocks(),
                    np.unique(entry.index.predict_next(selection)),
                    selection.block_ids.astype(np.int32),
                )

            def snapshot() -> Callable[[Callable[[], bool]], Callable[[], None]] | None:
                # in the worker too: a snapshot may compact the index first
                return entry.index.fit_later() if entry.index.fit_due() else None

            ranked, predicted, selected = await anyio.to_thread.run_sync(
                work, limiter=self._limiter
            )
            # only once the index holds them: a HINT cancelled while it waited for a worker
            # leaves the session as it found it, its new positions looked for again next time
            entry.pending = pending
            entry.chain = list(chain)
            if self._may_fit(entry):
                job = await anyio.to_thread.run_sync(snapshot, limiter=self._limiter)
                if job is not None and self._may_fit(entry) and self.spawn is not None:
                    self.spawn(partial(self._fit, entry, entry.index, job))
                    entry.fitting = entry.index  # counted once the job is the store's
                    self._fits += 1
        self._trim_sessions((ns.id, session))
        chosen = {int(p) for p in ranked}
        return SparseSelection(
            [chain[int(p)] for p in ranked],
            [chain[int(p)] for p in predicted if p >= 0 and int(p) not in chosen],
            selected,
            unsummarised,
        )

    def _may_fit(self, entry: _Session) -> bool:
        """Whether a background fit of ``entry``'s index may start now: a task group to own
        it and a store not closing, none running for this index, fewer than
        :data:`_FITS_AT_ONCE` running, and an index that outgrew its clusters."""
        return (
            self.spawn is not None
            and not self._closing
            and entry.fitting is not entry.index
            and self._fits < _FITS_AT_ONCE
            and entry.index.fit_due()
        )

    async def _fit(
        self,
        entry: _Session,
        index: SparseIndex,
        work: Callable[[Callable[[], bool]], Callable[[], None]],
    ) -> None:
        """Cluster ``index`` (``entry``'s when it started) in a worker thread, then install
        the clusters under the session's lock (in a worker thread too: the blocks indexed
        meanwhile join them). A closing store cancels it (:meth:`cancel_fits`)."""
        scope = anyio.CancelScope()
        if self._closing:  # the store began to close before this job ran
            scope.cancel()
        self._fit_scopes.add(scope)
        try:
            with scope:
                # the work reads a snapshot and changes nothing: a shutdown does not wait for
                # it, and tells its thread to stop (the process waits for its threads)
                install = await anyio.to_thread.run_sync(
                    partial(work, self._stopping.is_set),
                    limiter=self._fit_limiter,
                    abandon_on_cancel=True,
                )
                async with entry.lock:
                    await anyio.to_thread.run_sync(install, limiter=self._fit_limiter)
        except FitStopped:
            pass
        except Exception:  # the index goes on scoring every block; a later HINT tries again
            log.exception("sparse: clustering an index of %d blocks failed", len(index))
        finally:
            self._fit_scopes.discard(scope)
            if entry.fitting is index:
                entry.fitting = None
            self._fits -= 1

    def cancel_fits(self) -> None:
        """The store is closing: cancel the background fits, stop their threads, start none."""
        self._closing = True
        self._stopping.set()
        for scope in self._fit_scopes:
            scope.cancel()

    def _trim_sessions(self, current: tuple[int, bytes]) -> None:
        """Drop the least recently used sessions' indices, never ``current``'s, while all of
        them together hold more than :attr:`max_index_bytes`: a client naming many sessions
        over a long chain cannot make the daemon hold an index for each."""
        held = {key: entry.index.memory_bytes() for key, entry in self._sessions.items()}
        total = sum(held.values())
        for key in list(self._sessions):
            if total <= self.max_index_bytes:
                break
            if key != current:
                del self._sessions[key]
                total -= held[key]
                self.sessions_dropped += 1
                log.warning(
                    "sparse: dropped the index of session %r of namespace %d to stay within "
                    "%d bytes of indices",
                    key[1],
                    key[0],
                    self.max_index_bytes,
                )

    def _used(self, block_id: tuple[bytes, bytes]) -> np.ndarray | None:
        summary = self._summaries.get(block_id)
        if summary is not None:
            self._summaries.move_to_end(block_id)
        return summary

    def _session(
        self, ns: Namespace, session: bytes, queries: np.ndarray, query_layers: Sequence[int]
    ) -> _Session:
        layout = self.layout_of(ns)
        if queries.ndim not in (3, 4) or queries.shape[0] != len(query_layers):
            raise InvalidRequestError(
                "queries must be [len(query_layers), q_heads, (steps,) head_dim]"
            )
        if queries.shape[-1] != layout.head_dim or max(query_layers, default=-1) >= layout.layers:
            raise InvalidRequestError("queries do not match the namespace layout")
        config = SparseConfig(
            tuple(query_layers), queries.shape[1], layout.kv_heads, layout.head_dim
        )
        key = (ns.id, session)
        entry = self._sessions.get(key)
        if entry is None or entry.index.config != config:
            entry = _Session(SparseIndex(config))
            self._sessions[key] = entry
        self._sessions.move_to_end(key)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return entry
