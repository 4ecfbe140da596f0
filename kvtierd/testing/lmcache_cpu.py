"""A CPU "GPU connector" for LMCache: moves chunks between LMCache's memory objects and a KV
tensor in host memory.

LMCache's engine (``LMCacheEngine.store()`` / ``retrieve()``) moves KV through a
``GPUConnectorInterface``; its real connectors copy to and from vLLM's or SGLang's paged GPU
buffers and need CUDA. This one serves a plain contiguous cache per sequence, passed as the
keyword argument ``kvcaches``: a tensor ``[layers, 2, tokens, kv_heads, head_dim]`` in the
engine's dtype. A chunk's memory object is LMCache's ``KV_2LTD`` form ``[2, layers, chunk
tokens, kv_heads * head_dim]``; each move is one strided copy. Tests and the peer benchmark use
it to drive LMCache end to end on machines without a GPU; a CPU-only engine could too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

__all__ = ["CpuKvConnector"]


class CpuKvConnector(GPUConnectorInterface):  # type: ignore[misc]
    """Copies chunks between memory objects and ``kvcaches`` (see the module docstring)."""

    def __init__(self, kv_shape: Sequence[int]) -> None:
        """``kv_shape`` is LMCache's ``(layers, 2, chunk tokens, kv_heads, head_dim)``."""
        layers, kv, _, kv_heads, head_dim = (int(x) for x in kv_shape)
        if kv != 2:
            raise ValueError("CpuKvConnector moves K and V (kv_shape[1] == 2), not MLA")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.kv_heads * self.head_dim])

    def _cache_view(self, kvcaches: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """``kvcaches[:, :, start:end]`` as ``[2, layers, tokens, kv_heads * head_dim]``."""
        expected = (self.layers, 2, self.kv_heads, self.head_dim)
        got = (kvcaches.shape[0], kvcaches.shape[1], kvcaches.shape[3], kvcaches.shape[4])
        if kvcaches.dim() != 5 or got != expected:
            raise ValueError(
                f"kvcaches must be [layers, 2, tokens, kv_heads, head_dim] = {expected}"
            )
        return kvcaches[:, :, start:end].permute(1, 0, 2, 3, 4)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Copy tokens ``[start, end)`` of ``kvcaches`` into ``memory_obj``."""
        target = memory_obj.tensor.view(2, self.layers, end - start, self.kv_heads, self.head_dim)
        target.copy_(self._cache_view(kwargs["kvcaches"], start, end))

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        """Copy ``memory_obj`` into tokens ``[start, end)`` of ``kvcaches``."""
        source = memory_obj.tensor.view(2, self.layers, end - start, self.kv_heads, self.head_dim)
        self._cache_view(kwargs["kvcaches"], start, end).copy_(source)

    def batched_from_gpu(
        self, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int], **kwargs: Any
    ) -> None:
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: Sequence[Any] | None = None,
        starts: Sequence[int] | None = None,
        ends: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        if memory_objs is None or starts is None or ends is None:
            raise ValueError("CpuKvConnector moves whole chunks: pass memory_objs, starts, ends")
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, start, end, **kwargs)
