"""What the vLLM connector (``kvtierd.engines.vllm``) knows of vLLM's KV cache: its KV cache
groups and the namespace each group's blocks live in (the connector reaches the daemon through
:class:`kvtierd.engines.link.EngineLink`).

- :func:`cache_groups` reads vLLM's KV cache groups into :class:`~kvtierd.engines.vllm_groups.
  CacheGroups` (a kvtierd ``Layout`` per group, its sliding window if it has one) and refuses
  what the connector cannot fill; :func:`kv_format` names how vLLM's backend splits a block's K
  and V (the CPU kernel keeps K in a layout of its own), and :func:`namespace_name` puts
  everything that decides a block's bytes into the namespace's name.
"""

from __future__ import annotations

from typing import Any

import torch

from kvtierd.engines.vllm_groups import CacheGroups, KvGroup
from kvtierd.errors import KvtierError
from kvtierd.protocol.messages import Layout

__all__ = [
    "UnsupportedEngineError",
    "cache_groups",
    "kv_format",
    "namespace_name",
]

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

#: Parallelism that splits one block's layers or tokens across processes.
_SPLITTING_PARALLELISM = (
    "pipeline_parallel_size",
    "decode_context_parallel_size",
    "prefill_context_parallel_size",
)
#: The spec kinds whose blocks the connector stores and restores (exact types: vLLM's
#: subclasses of ``FullAttentionSpec``, MLA's among them, are other kinds).
_SERVED_SPECS = ("FullAttentionSpec", "SlidingWindowSpec")


class UnsupportedEngineError(KvtierError, TypeError):
    """vLLM's KV cache is of a kind this connector cannot fill (MLA, Mamba or other spec kinds
    than full and sliding-window attention, quantised KV, different K and V head sizes, groups
    of different block sizes, pipeline or context parallelism, kernel blocks smaller than
    vLLM's blocks)."""


def cache_groups(vllm_config: Any, kv_cache_config: Any, model_id: str | None) -> CacheGroups:
    """The kvtierd view of vLLM's KV cache: per KV cache group, one layer-major block per
    vLLM block of that group's layers.

    Raises:
        UnsupportedEngineError: a group of a spec kind other than full or sliding-window
            attention, or any of the class's other cases (the message names the spec).
    """
    specs = [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups]
    if not specs:
        raise UnsupportedEngineError("vLLM has no KV cache group (an attention-free model)")
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
    groups = tuple(
        _group(i, group.layer_names, group.kv_cache_spec, model_id)
        for i, group in enumerate(kv_cache_config.kv_cache_groups)
    )
    sizes = sorted({g.layout.block_tokens for g in groups})
    if len(sizes) > 1:
        raise UnsupportedEngineError(f"KV cache groups of different block sizes {sizes}")
    retention = vllm_config.cache_config.prefix_cache_retention_interval
    if retention is not None and retention % sizes[0]:
        raise UnsupportedEngineError(
            f"prefix_cache_retention_interval {retention} is not a multiple of the block size "
            f"{sizes[0]}"
        )
    return CacheGroups(groups, sizes[0], retention)


def _group(index: int, layer_names: Any, spec: Any, model_id: str) -> KvGroup:
    kind = type(spec).__name__
    if kind not in _SERVED_SPECS:
        raise UnsupportedEngineError(
            f"KV cache group {index} is {kind}; only {' and '.join(_SERVED_SPECS)} are served"
        )
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise UnsupportedEngineError(f"group {index} ({kind}): K and V head sizes differ")
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and getattr(quant, "name", "NONE") != "NONE":
        raise UnsupportedEngineError(f"group {index} ({kind}): quantised KV ({quant})")
    if spec.dtype not in _DTYPE_NAMES:
        raise UnsupportedEngineError(f"group {index} ({kind}): no kvtierd dtype for {spec.dtype}")
    layout = Layout(
        model_id=model_id,
        layers=len(layer_names),
        kv_heads=int(spec.num_kv_heads),
        head_dim=int(spec.head_size),
        dtype=_DTYPE_NAMES[spec.dtype],
        block_tokens=int(spec.block_size),
    )
    if kind == "SlidingWindowSpec":
        return KvGroup(
            index,
            tuple(layer_names),
            layout,
            window_tokens=int(spec.sliding_window),
            retained_tokens=int(getattr(spec, "extra_retained_tokens", 0) or 0),
        )
    # A FullAttentionSpec that names a window (vLLM with its hybrid manager turned off) keeps
    # every block, as vLLM does: served as full attention.
    return KvGroup(index, tuple(layer_names), layout)


def kv_format() -> str:
    """How vLLM's attention backend splits a block tile ``[kv_heads, block_tokens, C]`` into K
    and V: ``"cpu"``, the CPU kernel's, which views it as ``[kv_heads, 2·block_tokens, head_dim]``
    and keeps K in a vectorised layout of its own; ``"nhd"`` (GPU backends), K and V side by
    side in ``C``. Blocks of one format are meaningless in the other: it is in the namespace."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "nhd"


def namespace_name(layout: Layout, world_size: int, fmt: str, group: KvGroup | None = None) -> str:
    """``vllm/<model_id>/<dtype>/<block_tokens>t/tp<N>/<format>``, and for a group of a hybrid
    cache (several groups, or a sliding window) ``/<group tag>`` (:meth:`KvGroup.tag`: index,
    kind and window, a digest of its layers): what keeps blocks apart is in the name as well as
    in the layout, so an operator tells namespaces apart at a glance."""
    model = layout.model_id.strip("/")
    name = f"vllm/{model}/{layout.dtype}/{layout.block_tokens}t/tp{world_size}/{fmt}"
    return name if group is None else f"{name}/{group.tag()}"
