"""The bytes of a strided CPU tensor as the contiguous runs a block fills in order.

An engine's host page or cache slice is often a strided view (SGLang's ``page_first`` pages are
two runs, K and V; its ``layer_first`` pages one run per layer and half; a restored HF slab one
run per plane and head). A leased block is stored in the view's row-major order, so copying it
into the view is copying it into these runs one after the other: what
``BlockLease.copy_into(i, runs)`` does while it hashes the copy, one pass over memory instead of
a hash of the lease and then a torch copy.

The runs are slices of one byte view of the tensor's whole storage, found by arithmetic on the
strides (a few microseconds per run, not a torch indexing per run).
"""

from __future__ import annotations

import itertools

import torch

from kvtierd.client.arena import ByteRuns

__all__ = ["HostRuns", "byte_runs"]


class HostRuns:
    """:func:`byte_runs` for an engine that copies into the same host buffers again and again
    (its host pool, or one KV tensor per layer): the byte view of each storage is kept (about
    5 us saved per call), and so is the storage, for the last ``keep`` storages used."""

    def __init__(self, keep: int = 256) -> None:
        self._keep = keep
        self._views: dict[tuple[int, int], tuple[torch.UntypedStorage, memoryview]] = {}

    def __call__(self, tensor: torch.Tensor) -> list[memoryview]:
        """Writable byte views of ``tensor``'s elements in row-major order: one per contiguous
        run (one for a contiguous tensor). ``tensor`` must live in host memory."""
        storage, spans = self.spans(tensor)
        return [storage[start:stop] for start, stop in spans]

    def byte_runs(self, tensor: torch.Tensor) -> ByteRuns:
        """The runs of ``tensor`` (all of one length) as :class:`ByteRuns`, which
        ``BlockLease.copy_into`` fills in one native call, not a Python step per run."""
        storage, spans = self.spans(tensor)
        length = spans[0][1] - spans[0][0] if spans else 0
        return ByteRuns(storage, [start for start, _ in spans], length)

    def spans(self, tensor: torch.Tensor) -> tuple[memoryview, list[tuple[int, int]]]:
        """A writable byte view of ``tensor``'s whole storage and where its runs lie in it
        (``[start, stop)`` byte ranges, row-major order): for an engine that precomputes the
        runs of one block of a paged cache and shifts them to reach the others."""
        if tensor.device.type != "cpu":
            raise ValueError(f"byte runs need a tensor in host memory, not on {tensor.device}")
        storage = tensor.untyped_storage()
        where = (storage.data_ptr(), storage.nbytes())
        held = self._views.get(where)
        if held is None:  # a storage kept here is alive, so no other can have its address
            while len(self._views) >= self._keep:
                del self._views[next(iter(self._views))]
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)
            held = self._views[where] = (storage, memoryview(whole.numpy().data))
        return held[1], _spans(tensor) if tensor.numel() else []


def byte_runs(tensor: torch.Tensor) -> list[memoryview]:
    """Writable byte views of ``tensor``'s elements in row-major order, one per contiguous run
    (see :class:`HostRuns`, which keeps the storage's view between calls)."""
    return HostRuns()(tensor)


def _spans(tensor: torch.Tensor) -> list[tuple[int, int]]:
    size = tensor.element_size()
    shape, strides = [int(n) for n in tensor.shape], [int(s) for s in tensor.stride()]
    dims = [(n, s) for n, s in zip(shape, strides, strict=True) if n != 1]
    run, inner = 1, len(dims)
    while inner and dims[inner - 1][1] == run:  # the trailing dimensions that are contiguous
        run *= dims[inner - 1][0]
        inner -= 1
    base = int(tensor.storage_offset())
    ranges = [range(0, n * s, s) for n, s in dims[:inner]]
    starts = [base + sum(p) for p in itertools.product(*ranges)]
    return [(s * size, (s + run) * size) for s in starts]
