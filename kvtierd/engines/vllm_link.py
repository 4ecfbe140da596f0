"""What the vLLM connector (``kvtierd.engines.vllm``) knows of vLLM's KV cache and of the
daemon: the namespace a vLLM engine's blocks live in, and the connection to it.

- :func:`vllm_layout` reads vLLM's KV cache spec into a kvtierd ``Layout`` and refuses what
  the connector cannot fill; :func:`kv_format` names how vLLM's backend splits a block's K and V
  (the CPU kernel keeps K in a layout of its own), and :func:`namespace_name` puts everything
  that decides a block's bytes into the namespace's name.
- :class:`Link` holds one :class:`Session` (a client and the namespace opened on it), opens it on
  first use and again after the daemon restarted. Only a broken connection drops a session; a
  refusal (no space, quota) is a miss on a session that stays.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from typing import Any

import torch

from kvtierd.client import Client, Namespace, connect
from kvtierd.client.cuda import PinnedRegion
from kvtierd.engines.vllm_plan import ConnectorSettings
from kvtierd.errors import CONNECTION_ERRORS, KvtierError
from kvtierd.protocol.messages import Layout

__all__ = [
    "Link",
    "Session",
    "UnsupportedEngineError",
    "kv_format",
    "namespace_name",
    "vllm_layout",
]

log = logging.getLogger("kvtierd.vllm")

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


class Session:
    """A connection and the namespace opened on it; replaced after the daemon went away."""

    def __init__(self, settings: ConnectorSettings, layout: Layout, rank: int, world: int):
        self.client: Client = connect(
            settings.socket, client_name="vllm", timeout_s=settings.timeout_s
        )
        try:
            self.namespace: Namespace = self.client.namespace(
                settings.namespace or namespace_name(layout, world, kv_format()),
                layout=layout,
                rank=rank,
                world_size=world,
                tenant=settings.tenant,
            )
        except BaseException:
            self.client.close()
            raise
        self._arena: torch.Tensor | None = None
        self._pinned: PinnedRegion | None = None

    def arena(self, device: torch.device | None = None) -> torch.Tensor:
        """The namespace's region as one ``uint8`` tensor (read through lease extents; the
        tensor keeps the mapping alive after the session closes). For a CUDA ``device`` (where
        the KV cache lives) the mapping is also registered as pinned host memory, once per
        session (:class:`kvtierd.client.cuda.PinnedRegion`), so the connector's
        ``non_blocking`` copies into the cache are DMA instead of staged through a bounce
        buffer."""
        if self._arena is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*not writable.*")
                self._arena = torch.frombuffer(self.namespace.arena_buffer(), dtype=torch.uint8)
        if device is not None and self._pinned is None:
            self._pinned = PinnedRegion(self._arena, device)
            self._pinned.pin()  # nothing to do for a CPU device
        return self._arena

    def close(self) -> None:
        if self._pinned is not None:  # the connector's copies out of it are synchronised
            with contextlib.suppress(KvtierError):
                self._pinned.unpin()
            self._pinned = None
        self._arena = None
        with contextlib.suppress(KvtierError, OSError):
            self.client.close()


class Link:
    """The connector's session, opened on first use and after the daemon restarted; every
    failure to reach the daemon is a cache miss, logged once per outage."""

    def __init__(self, settings: ConnectorSettings, layout: Layout, rank: int, world: int):
        self._args = (settings, layout, rank, world)
        self._session: Session | None = None
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._closed = False

    def get(self) -> Session | None:
        """The open session, reconnecting if needed; ``None`` when the daemon is unreachable
        or the connector shut down."""
        with self._lock:
            if self._closed:
                return None
            if self._session is not None and not self._session.client.connected():
                self._session.close()
                self._session = None
            if self._session is None:
                try:
                    self._session = Session(*self._args)
                except (KvtierError, OSError) as exc:  # OSError: reset during the handshake
                    self._failed(exc)
                    return None
                if self._down_since is not None:
                    log.warning("kvtierd is reachable again")
                    self._down_since = None
            return self._session

    def _failed(self, exc: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("kvtierd unreachable, serving without it: %s", exc)

    def failed(self, exc: KvtierError) -> None:
        """A call failed: a broken connection drops the session (the next call reconnects); a
        refusal only is logged."""
        if not isinstance(exc, CONNECTION_ERRORS):
            log.info("kvtierd refused a request: %s", exc)
            return
        with self._lock:
            self._failed(exc)
            if self._session is not None:
                self._session.close()
                self._session = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._session is not None:
                self._session.close()
                self._session = None
