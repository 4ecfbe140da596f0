"""What the vLLM connector (``kvtierd.engines.vllm``) knows of vLLM's KV cache: the namespace
a vLLM engine's blocks live in (the connector reaches the daemon through
:class:`kvtierd.engines.link.EngineLink`).

- :func:`vllm_layout` reads vLLM's KV cache spec into a kvtierd ``Layout`` and refuses what
  the connector cannot fill; :func:`kv_format` names how vLLM's backend splits a block's K and V
  (the CPU kernel keeps K in a layout of its own), and :func:`namespace_name` puts everything
  that decides a block's bytes into the namespace's name.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtierd.errors import KvtierError
from kvtierd.protocol.messages import Layout

__all__ = [
    "UnsupportedEngineError",
    "kv_format",
    "namespace_name",
    "vllm_layout",
]

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

#: Parallelism that splits one block's layers or tokens across processes.
_SPLITTING_PARALLELISM = (
    "pipeline_parallel_size",
    "decode_context_parallel_size",
    "prefill_context_parallel_size",
)


class UnsupportedEngineError(KvtierError, TypeError):
    """vLLM's KV cache is of a kind this connector cannot fill (hybrid or sliding-window
    groups, MLA, quantised KV, different K and V head sizes, pipeline or context parallelism,
    kernel blocks smaller than vLLM's blocks)."""


def vllm_layout(vllm_config: Any, kv_cache_config: Any, model_id: str | None) -> Layout:
    """The kvtierd layout of vLLM's KV cache: one layer-major block per vLLM block.

    Raises:
        UnsupportedEngineError: not one group of plain full-attention layers on one pipeline
            stage without context parallelism.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise UnsupportedEngineError(f"one KV cache group expected, vLLM has {len(groups)}")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind != "FullAttentionSpec" or getattr(spec, "sliding_window", None):
        raise UnsupportedEngineError(f"only full attention is supported, vLLM has {kind}")
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise UnsupportedEngineError("K and V head sizes differ")
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and getattr(quant, "name", "NONE") != "NONE":
        raise UnsupportedEngineError(f"quantised KV ({quant}) is not supported")
    if spec.dtype not in _DTYPE_NAMES:
        raise UnsupportedEngineError(f"no kvtierd dtype name for {spec.dtype}")
    if vllm_config.model_config.use_mla:
        raise UnsupportedEngineError("MLA caches are not supported")
    parallel = vllm_config.parallel_config
    for name in _SPLITTING_PARALLELISM:
        if int(getattr(parallel, name, 1) or 1) != 1:
            raise UnsupportedEngineError(
                f"{name} > 1 is not supported (each stage or rank would hold part of a block "
                "under one namespace)"
            )
    if model_id is None:
        mc = vllm_config.model_config
        model_id = str(mc.model)
        if mc.revision:
            model_id += f"@{mc.revision}"
        if mc.quantization:
            model_id += f"/{mc.quantization}"
    return Layout(
        model_id=model_id,
        layers=len(groups[0].layer_names),
        kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        dtype=_DTYPE_NAMES[spec.dtype],
        block_tokens=int(spec.block_size),
    )


def kv_format() -> str:
    """How vLLM's attention backend splits a block tile ``[kv_heads, block_tokens, C]`` into K
    and V: ``"cpu"``, the CPU kernel's, which views it as ``[kv_heads, 2·block_tokens, head_dim]``
    and keeps K in a vectorised layout of its own; ``"nhd"`` (GPU backends), K and V side by
    side in ``C``. Blocks of one format are meaningless in the other: it is in the namespace."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "nhd"


def namespace_name(layout: Layout, world_size: int, fmt: str) -> str:
    """``vllm/<model_id>/<dtype>/<block_tokens>t/tp<N>/<format>``: what keeps blocks apart is
    in the name as well as in the layout, so an operator tells namespaces apart at a glance."""
    model = layout.model_id.strip("/")
    return f"vllm/{model}/{layout.dtype}/{layout.block_tokens}t/tp{world_size}/{fmt}"
