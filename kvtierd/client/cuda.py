"""The last hop on a GPU host: leased blocks into an engine's KV tensors, layer by layer.

A block is layer-major, ``[2L, kv_heads, block_tokens, head_dim]`` (plane ``2l`` is layer
``l``'s K, ``2l + 1`` its V: :mod:`kvtierd.engines.hf_cache`). The destination is an engine's
``planes``, ``[2L, kv_heads, tokens, head_dim]`` on its device; blocks ``0 .. n-1`` fill tokens
``start .. start + n * block_tokens``.

On a CUDA device:

* :class:`PinnedRegion` registers the client's mapping of its tenant region as pinned host
  memory (``cudaHostRegister`` through torch's cudart), once, so copies out of the arena are DMA
  that do not hold the host, instead of the driver staging them through a bounce buffer;
* :func:`deliver` issues, for each layer in order on one stream, a ``cudaMemcpyAsync`` per
  block of that layer's two planes (contiguous in the block) into a device staging buffer, then
  one kernel that scatters the buffer into the layer's token range, and records an event (on
  the host the planes are copied straight into place);
* :meth:`Delivery.wait` makes the engine's stream wait for one layer's event (no host
  synchronisation), so the engine can run layer 0 while later layers are still on the wire;
  :meth:`Delivery.finish` waits on the host for the last layer and only then ends the lease,
  so no block's slot is given back while a copy may still read it.

Without CUDA the same code runs on CPU tensors: each copy is done when it is issued and the
events are ``None`` (``wait`` returns at once), so the pipeline's order, offsets and checks are
tested on every machine.

The lease's blocks were verified (xxh3-64) when they were leased; a client of the same tenant
that writes to the region between that check and the copy changes what its own engine gets,
nothing else (the region is that tenant's alone).
"""

from __future__ import annotations

import contextlib
import errno
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtierd.client.blocks import BlockLease
from kvtierd.errors import InvalidRequestError, KvtierError
from kvtierd.protocol.messages import Layout

__all__ = [
    "CudaError",
    "Delivery",
    "KvGeometry",
    "PinnedRegion",
    "block_tensors",
    "deliver",
    "delivered",
]

#: The torch dtypes of the dtype names a :class:`Layout` may carry.
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


class CudaError(KvtierError):
    """A CUDA runtime call failed (its ``cudaError_t`` is in the message; ``EIO``)."""

    errno = errno.EIO


@dataclass(frozen=True)
class KvGeometry:
    """The shape of one layer-major block."""

    layers: int
    kv_heads: int
    block_tokens: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, layout: Layout) -> KvGeometry:
        dtype = _DTYPES.get(layout.dtype)
        if dtype is None:
            raise InvalidRequestError(f"no torch dtype for a layout of {layout.dtype!r}")
        return cls(layout.layers, layout.kv_heads, layout.block_tokens, layout.head_dim, dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        return (2 * self.layers, self.kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return (
            2 * self.layers * self.kv_heads * self.block_tokens * self.head_dim
        ) * self.dtype.itemsize


def block_tensors(lease: BlockLease, geometry: KvGeometry) -> list[torch.Tensor]:
    """The leased blocks as read-only ``[2L, kv_heads, block_tokens, head_dim]`` tensors over
    the arena (no copy), valid while the lease is held."""
    blocks = []
    for view in lease.views:
        if len(view) != geometry.block_bytes:
            raise InvalidRequestError(
                f"a leased block of {len(view)} bytes is not one of {geometry.block_bytes}"
            )
        with warnings.catch_warnings():  # the mapping is shared; it is only read through these
            warnings.filterwarnings("ignore", message=".*not writable.*")
            raw = torch.frombuffer(view, dtype=torch.uint8)
        blocks.append(raw.view(geometry.dtype).view(geometry.block_shape))
    return blocks


class PinnedRegion:
    """A host buffer registered as pinned memory with CUDA while the context is open; on a
    CPU device, nothing to do. Register a client's arena mapping once, not per lease:
    registering a GiB takes tens of milliseconds."""

    def __init__(self, buffer: torch.Tensor, device: torch.device | str) -> None:
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise InvalidRequestError("only a contiguous host buffer can be pinned")
        self.buffer = buffer
        self.device = torch.device(device)
        self.registered = False

    def pin(self) -> None:
        """Register the buffer (on a CUDA device; nothing on the CPU); idempotent."""
        if self.device.type == "cuda" and self.buffer.numel() and not self.registered:
            nbytes = self.buffer.numel() * self.buffer.element_size()
            _check(
                _cudart().cudaHostRegister(self.buffer.data_ptr(), nbytes, 0),
                "cudaHostRegister",
            )
            self.registered = True

    def unpin(self) -> None:
        """Unregister it again (no copy may still read it); idempotent."""
        if self.registered:
            self.registered = False
            _check(_cudart().cudaHostUnregister(self.buffer.data_ptr()), "unregister")

    def __enter__(self) -> PinnedRegion:
        self.pin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.unpin()


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _check(status: Any, what: str) -> None:
    code = int(getattr(status, "value", status))
    if code != 0:
        raise CudaError(f"{what} failed: cudaError_t {code}")


@dataclass
class Delivery:
    """Copies issued by :func:`deliver`; ``events[l]`` is recorded after layer ``l``'s copies
    (``None`` on CPU, where they are done already)."""

    device: torch.device
    events: list[Any]
    lease: BlockLease | None = None
    _finished: bool = field(default=False)

    @property
    def layers(self) -> int:
        return len(self.events)

    def wait(self, layer: int) -> None:
        """Make the current stream of the destination's device wait until ``layer`` is in
        place (on CPU it is: nothing to wait for)."""
        if not 0 <= layer < self.layers:
            raise InvalidRequestError(f"layer {layer} is not in 0..{self.layers - 1}")
        event = self.events[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def ready(self, layer: int) -> bool:
        """Whether ``layer``'s copies have completed, without waiting."""
        if not 0 <= layer < self.layers:
            raise InvalidRequestError(f"layer {layer} is not in 0..{self.layers - 1}")
        event = self.events[layer]
        return event is None or bool(event.query())

    def finish(self) -> None:
        """Wait on the host for every copy, then end the lease (idempotent)."""
        if self._finished:
            return
        self._finished = True
        try:
            if self.events and self.events[-1] is not None:
                self.events[-1].synchronize()
        finally:
            if self.lease is not None:
                self.lease.release()

    def __enter__(self) -> Delivery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


def deliver(
    blocks: Sequence[torch.Tensor],
    planes: torch.Tensor,
    start_token: int,
    *,
    lease: BlockLease | None = None,
    stream: Any = None,
) -> Delivery:
    """Copy ``blocks`` (each ``[2L, kv_heads, block_tokens, head_dim]``, host memory) into
    ``planes`` (``[2L, kv_heads, tokens, head_dim]``) at tokens ``start_token ..``, layer by
    layer (see the module). ``lease``: the lease the blocks are viewed in, ended by
    :meth:`Delivery.finish` once the copies are done. ``stream``: the CUDA stream to copy on
    (default: a new one, so the copies overlap the engine's work on its own stream)."""
    device = planes.device
    n = len(blocks)
    if planes.dim() != 4 or planes.shape[0] % 2:
        raise InvalidRequestError(f"planes of shape {tuple(planes.shape)} are not [2L, H, T, D]")
    two_l, heads, tokens, dim = (int(s) for s in planes.shape)
    bt = int(blocks[0].shape[2]) if n else 1
    shape = (two_l, heads, bt, dim)
    for block in blocks:
        if tuple(block.shape) != shape or block.dtype != planes.dtype:
            raise InvalidRequestError(
                f"a block of {tuple(block.shape)} {block.dtype} does not fit planes of "
                f"{tuple(planes.shape)} {planes.dtype} (expected {shape})"
            )
        if block.device.type != "cpu" or not block.is_contiguous():
            raise InvalidRequestError("blocks are delivered from contiguous host memory")
    if not 0 <= start_token <= tokens - n * bt:
        raise InvalidRequestError(
            f"{n} blocks of {bt} tokens from token {start_token} do not fit {tokens} tokens"
        )
    cuda = device.type == "cuda"
    if cuda and stream is None:
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    events: list[Any] = []
    span = slice(start_token, start_token + n * bt)
    # Across to a device: each block's planes (contiguous) into a staging buffer there, then
    # one scatter kernel; on the host the planes are copied straight into place.
    staging = (
        torch.empty((n, 2, heads, bt, dim), dtype=planes.dtype, device=device) if cuda else None
    )
    with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
        if cuda:  # the destination may be in use by the engine's stream until now
            stream.wait_stream(torch.cuda.current_stream(device))
        for layer in range(two_l // 2):
            target = planes[2 * layer : 2 * layer + 2, :, span].view(2, heads, n, bt, dim)
            for b, block in enumerate(blocks):
                planes_of_layer = block[2 * layer : 2 * layer + 2]
                if staging is None:
                    target[:, :, b].copy_(planes_of_layer)
                else:
                    staging[b].copy_(planes_of_layer, non_blocking=True)
            if staging is not None:
                target.copy_(staging.permute(1, 2, 0, 3, 4))
            events.append(_recorded(stream) if cuda else None)
    return Delivery(device, events, lease)


def _recorded(stream: Any) -> Any:
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


@contextlib.contextmanager
def delivered(
    lease: BlockLease, geometry: KvGeometry, planes: torch.Tensor, start_token: int
) -> Iterator[Delivery]:
    """:func:`deliver` of a lease's blocks, finished (copies done, lease ended) on exit."""
    with deliver(block_tensors(lease, geometry), planes, start_token, lease=lease) as delivery:
        yield delivery
