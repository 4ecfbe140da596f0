"""kvtierd under vLLM: a ``KVConnectorBase_V1`` connector (vLLM 0.32, V1 engine).

Enable it with::

    LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="KvtierdConnector",
        kv_connector_module_path="kvtierd.engines.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"socket": "/run/kvtierd/kvtierd.sock"},  # optional
    ))

vLLM builds two instances: the **scheduler** side answers ``get_num_new_matched_tokens`` from
one LOOKUP of the request's block keys, leases the DRAM-resident hits at once (READ_RESIDENT:
no eviction can take what vLLM was promised) and, while hits are still on their way up from
NVMe, answers "ask again" instead of waiting; it tells the worker which blocks to load and
which to save. The **worker** side loads layer by layer from the arena into vLLM's paged KV
tensors (one copy per layer and block) and saves a step's completed prompt blocks with the
two-phase write: arena slots are allocated before the forward, each layer's K and V copied in as
vLLM writes them, and the blocks committed after the step (abandoned, never visible, if
anything fails). A block that vanished between lookup and load is reported to vLLM as a load
error: with ``kv_load_failure_policy="recompute"`` vLLM recomputes it.

Keys are kvtierd's chain keys over the prompt's token ids, not vLLM's block hashes: those depend
on an engine setting (``prefix_caching_hash_algo``: the ``xxhash`` ones are seeded at random per
process unless ``PYTHONHASHSEED`` is set) and on vLLM's internal format, so another setting or a
vLLM upgrade would make everything kvtierd holds unreachable. What changes the KV besides the tokens keeps keys apart: the model,
its quantisation, the KV dtype and shape, the block size and the TP rank are in the namespace
(name and layout), the request's ``cache_salt`` and LoRA adapter in each key's salt. Requests
with multimodal inputs or prompt embeddings are neither looked up nor saved. See
``docs/engines.md`` ("vLLM").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtierd.client import BlockLease, Client, Namespace, connect
from kvtierd.engines.vllm_plan import (
    BlockRun,
    ConnectorSettings,
    Promotion,
    RequestPlan,
    loadable_blocks,
)
from kvtierd.errors import (
    BlockNotFoundError,
    BrokenConnectionError,
    KvtierError,
    NoSpaceError,
    QuotaError,
)
from kvtierd.keys import chain_keys
from kvtierd.protocol.messages import Extent, Layout

__all__ = [
    "ConnectorSettings",
    "KvtierdConnector",
    "KvtierdConnectorMetadata",
    "UnsupportedEngineError",
    "namespace_name",
    "vllm_layout",
]

log = logging.getLogger("kvtierd.vllm")

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class UnsupportedEngineError(KvtierError, TypeError):
    """vLLM's KV cache is of a kind this connector cannot fill (hybrid or sliding-window
    groups, MLA, quantised KV, different K and V head sizes)."""


def vllm_layout(vllm_config: Any, kv_cache_config: Any, model_id: str | None) -> Layout:
    """The kvtierd layout of vLLM's KV cache: one layer-major block per vLLM block.

    Raises:
        UnsupportedEngineError: not one group of plain full-attention layers.
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


def namespace_name(layout: Layout, world_size: int) -> str:
    """``vllm/<model_id>/<dtype>/<block_tokens>t/tp<N>``: what keeps blocks apart is in the
    name as well as in the layout, so an operator tells the namespaces apart at a glance."""
    model = layout.model_id.strip("/")
    return f"vllm/{model}/{layout.dtype}/{layout.block_tokens}t/tp{world_size}"


def _block_bytes(layout: Layout) -> int:
    itemsize = torch.empty((), dtype=getattr(torch, layout.dtype)).element_size()
    return 2 * layout.layers * layout.kv_heads * layout.head_dim * layout.block_tokens * itemsize


@dataclass
class KvtierdConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped
    """What one step asks of the worker: runs of blocks to load and to save."""

    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)


class _Session:
    """A connection and the namespace opened on it; replaced after the daemon went away."""

    def __init__(self, settings: ConnectorSettings, layout: Layout, rank: int, world: int):
        self.client: Client = connect(settings.socket, client_name="vllm")
        try:
            self.namespace: Namespace = self.client.namespace(
                settings.namespace or namespace_name(layout, world),
                block_bytes=_block_bytes(layout),
                layout=layout,
                rank=rank,
                world_size=world,
                tenant=settings.tenant,
            )
        except BaseException:
            self.client.close()
            raise
        self._arena: torch.Tensor | None = None

    def arena(self) -> torch.Tensor:
        """The namespace's region as one ``uint8`` tensor (read through lease extents)."""
        if self._arena is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*not writable.*")
                self._arena = torch.frombuffer(self.namespace.arena_buffer(), dtype=torch.uint8)
        return self._arena

    def close(self) -> None:
        self._arena = None
        with contextlib.suppress(KvtierError, OSError):
            self.client.close()


class _Link:
    """The connector's session, opened on first use and after the daemon restarted; every
    failure to reach the daemon is a cache miss, logged once per outage."""

    def __init__(self, settings: ConnectorSettings, layout: Layout, rank: int, world: int):
        self._args = (settings, layout, rank, world)
        self._session: _Session | None = None
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._closed = False

    def get(self) -> _Session | None:
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
                    self._session = _Session(*self._args)
                except KvtierError as exc:
                    self.failed(exc)
                    return None
                if self._down_since is not None:
                    log.warning("kvtierd is reachable again")
                    self._down_since = None
            return self._session

    def failed(self, exc: BaseException) -> None:
        """Log the first failure of an outage (called with or without the lock)."""
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("kvtierd unreachable, serving without it: %s", exc)

    def drop(self, exc: BaseException) -> None:
        """The session broke mid-call: forget it (the next call reconnects)."""
        with self._lock:
            self.failed(exc)
            if self._session is not None:
                self._session.close()
                self._session = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._session is not None:
                self._session.close()
                self._session = None


def _tp_position(vllm_config: Any, role: KVConnectorRole) -> tuple[int, int]:
    world = int(vllm_config.parallel_config.tensor_parallel_size)
    if role != KVConnectorRole.WORKER or world == 1:
        return 0, world
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), world


class KvtierdConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM is untyped
    """kvtierd as vLLM's KV connector (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra(
            dict(self._kv_transfer_config.kv_connector_extra_config or {})
        )
        self.layout = vllm_layout(vllm_config, kv_cache_config, self.settings.model_id)
        self._block_tokens = self.layout.block_tokens
        rank, world = _tp_position(vllm_config, role)
        self._link = _Link(self.settings, self.layout, rank, world)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a kvtierd block lost between lookup and load "
                'fails the request; set kv_load_failure_policy="recompute" to recompute it',
                self._kv_transfer_config.kv_load_failure_policy,
            )
        # scheduler side
        self._plans: dict[str, RequestPlan] = {}
        self._leases: dict[str, BlockLease] = {}
        self._promotions: dict[str, Promotion] = {}
        self._release_after: deque[list[BlockLease]] = deque()
        # worker side
        self._layers: dict[str, int] = {
            name: i for i, name in enumerate(kv_cache_config.kv_cache_groups[0].layer_names)
        }
        self._kv: dict[str, torch.Tensor] = {}
        self._on_device = False
        self._loading: list[tuple[BlockLease, tuple[int, ...], _Session]] = []
        self._saving: contextlib.ExitStack | None = None
        self._save_slots: list[tuple[int, torch.Tensor]] = []
        self._saves_pending = False
        self._load_errors: set[int] = set()
        self.counters = {
            "lookups": 0,
            "hit_tokens": 0,
            "loaded_blocks": 0,
            "saved_blocks": 0,
            "load_failures": 0,
            "save_failures": 0,
        }

    # -- scheduler side ----------------------------------------------------------------------

    def _request_keys(self, request: Any, session: _Session) -> tuple[bytes, ...]:
        if request.mm_features or getattr(request, "prompt_embeds", None) is not None:
            return ()
        tokens = request.prompt_token_ids or []
        salt = session.namespace.key_salt
        if request.cache_salt:
            salt += b"|salt:" + request.cache_salt.encode()
        if request.lora_request is not None:
            salt += b"|lora:" + request.lora_request.lora_name.encode()
        return tuple(chain_keys(tokens, self._block_tokens, salt))

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id = request.request_id
        self._drop_lease(req_id)
        session = self._link.get()
        if session is None:
            return 0, False
        bt = self._block_tokens
        plan = self._plans.get(req_id)
        if plan is None:
            keys = self._request_keys(request, session)
            plan = RequestPlan(req_id, len(request.prompt_token_ids or []), keys)
            self._plans[req_id] = plan
        limit = loadable_blocks(plan.prompt_tokens, bt)
        local = num_computed_tokens // bt
        try:
            tiers = session.namespace.lookup_tiers(plan.keys[:limit]) if limit else []
            self.counters["lookups"] += 1
            stored = len(tiers)
            if stored <= local:
                plan.promise(local, stored)
                return 0, False
            lease = session.namespace.acquire(plan.keys[local:stored], resident_only=True)
        except KvtierError as exc:
            self._link.drop(exc)
            return 0, False
        resident = len(lease.keys)
        if resident < stored - local:
            # Hits still on their way up from NVMe (LOOKUP started promoting them): ask again
            # next step rather than wait, while DRAM fills with them.
            now = time.monotonic()
            promotion = self._promotions.setdefault(
                req_id, Promotion(now, self.settings.wait_for_promotion_s)
            )
            if promotion.ask_again(resident, now):
                lease.release()
                return None, False
        self._promotions.pop(req_id, None)
        promised = plan.promise(local, stored)
        if promised and lease.keys:
            self._leases[req_id] = lease
        else:
            lease.release()
        return promised * bt, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None:
            return
        plan.allocated(blocks.get_block_ids()[0], num_external_tokens, self._block_tokens)
        if num_external_tokens == 0:
            self._drop_lease(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> KvtierdConnectorMetadata:
        meta = KvtierdConnectorMetadata()
        bt = self._block_tokens
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            plan = self._plans.get(new.req_id)
            if plan is None:
                continue
            plan.block_ids = list(new.block_ids[0])
            self._plan_step(meta, plan, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self._plans.get(req_id)
            if plan is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                plan.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                plan.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            if done <= plan.prompt_tokens + bt:  # decoding past the prompt saves nothing
                self._plan_step(meta, plan, done)
        # The leases of this step's loads end once its output is back.
        released = [self._leases.pop(run.request_id, None) for run in meta.loads]
        self._release_after.append([lease for lease in released if lease is not None])
        return meta

    def _plan_step(self, meta: KvtierdConnectorMetadata, plan: RequestPlan, done: int) -> None:
        load = plan.take_load()
        if load is not None:
            meta.loads.append(load)
            self.counters["hit_tokens"] += len(load.keys) * self._block_tokens
        save = plan.take_save(done, self._block_tokens)
        if save is not None:
            meta.saves.append(save)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._release_after:
            for lease in self._release_after.popleft():
                lease.release()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        req_id = request.request_id
        self._plans.pop(req_id, None)
        self._promotions.pop(req_id, None)
        self._drop_lease(req_id)
        return False, None

    def _drop_lease(self, req_id: str) -> None:
        lease = self._leases.pop(req_id, None)
        if lease is not None:
            lease.release()

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        lo = self.layout
        want = (lo.kv_heads, lo.block_tokens, 2 * lo.head_dim)
        for name, tensor in kv_caches.items():
            if name not in self._layers:
                raise UnsupportedEngineError(f"vLLM layer {name!r} is not in the KV cache group")
            if tuple(tensor.shape[1:]) != want or tensor.dtype != getattr(torch, lo.dtype):
                raise UnsupportedEngineError(
                    f"{name}: KV cache {tuple(tensor.shape)} {tensor.dtype}, expected "
                    f"[blocks, {want[0]}, {want[1]}, {want[2]}] {lo.dtype}"
                )
        self._kv = dict(kv_caches)
        self._on_device = any(t.device.type != "cpu" for t in kv_caches.values())

    def _planes(self, tensor: torch.Tensor, block_id: int) -> torch.Tensor:
        """vLLM block ``block_id`` of one layer as ``[2, kv_heads, block_tokens, head_dim]``
        (K then V: kvtierd's layer-major planes) over vLLM's ``[H, N, K|V]`` memory."""
        tile = tensor[block_id]
        return tile.view(*tile.shape[:-1], 2, self.layout.head_dim).permute(2, 0, 1, 3)

    def _block_planes(self, raw: torch.Tensor) -> torch.Tensor:
        lo = self.layout
        shape = (2 * lo.layers, lo.kv_heads, lo.block_tokens, lo.head_dim)
        return raw.view(getattr(torch, lo.dtype)).view(shape)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._abandon_saves()  # a step that raised before wait_for_save
        self._finish_loads()
        super().bind_connector_metadata(connector_metadata)
        self._saves_pending = bool(getattr(connector_metadata, "saves", None))

    def _extent_planes(self, arena: torch.Tensor, extent: Extent) -> torch.Tensor:
        return self._block_planes(arena[extent.offset : extent.offset + extent.length])

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # vLLM calls this before the forward when the step has loads, after it otherwise.
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierdConnectorMetadata)
        if meta.loads:
            session = self._link.get()
            for run in meta.loads:
                self._start_load(session, run)

    def _start_load(self, session: _Session | None, run: BlockRun) -> None:
        """Lease the run's blocks for the layer-by-layer copy; a run larger than this
        connection may pin is copied now, in batches; what cannot be read is a load error."""
        got = 0
        if session is not None:
            try:
                try:
                    lease = session.namespace.acquire(list(run.keys))
                except BlockNotFoundError:  # one is gone: take what is still in DRAM
                    lease = session.namespace.acquire(list(run.keys), resident_only=True)
                except (QuotaError, NoSpaceError):  # more than DRAM lets one connection hold
                    got = self._load_in_batches(session, run)
                else:
                    got = len(lease.keys)
                    self._loading.append((lease, run.block_ids[:got], session))
            except KvtierError as exc:
                self._link.drop(exc)
        self.counters["loaded_blocks"] += got
        if got < len(run.keys):
            self._load_errors.update(run.block_ids[got:])
            self.counters["load_failures"] += len(run.keys) - got

    def _load_in_batches(self, session: _Session, run: BlockRun) -> int:
        """Copy the run's blocks, every layer at once, a batch at a time (halving the batch
        while the daemon refuses it); returns how many leading blocks were copied."""
        done, batch = 0, max(1, len(run.keys) // 2)
        layers = [(self._layers[name], tensor) for name, tensor in self._kv.items()]
        while done < len(run.keys):
            try:
                lease = session.namespace.acquire(list(run.keys[done : done + batch]))
            except (QuotaError, NoSpaceError):
                if batch == 1:
                    return done
                batch //= 2
                continue
            except BlockNotFoundError:
                return done
            with lease:
                arena = session.arena()
                for extent, block_id in zip(lease.extents, run.block_ids[done:], strict=False):
                    planes = self._extent_planes(arena, extent)
                    for layer, tensor in layers:
                        self._planes(tensor, block_id).copy_(planes[2 * layer : 2 * layer + 2])
            done += len(lease.keys)
        return done

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loading:
            return
        layer = self._layers[layer_name]
        tensor = self._kv[layer_name]
        for lease, block_ids, session in self._loading:
            arena = session.arena()
            for extent, block_id in zip(lease.extents, block_ids, strict=False):
                src = self._extent_planes(arena, extent)[2 * layer : 2 * layer + 2]
                self._planes(tensor, block_id).copy_(src, non_blocking=True)
        if layer == len(self._layers) - 1:
            self._finish_loads()

    def _finish_loads(self) -> None:
        loading, self._loading = self._loading, []
        if loading and self._on_device:  # the copies read the arena until they complete
            torch.cuda.current_stream().synchronize()
        for lease, _, _ in loading:
            lease.release()

    def _start_saves(self) -> None:
        """Allocate the step's save slots (ALLOC), at its first layer."""
        self._saves_pending = False
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierdConnectorMetadata)
        saves = meta.saves
        session = self._link.get()
        if session is None:
            self.counters["save_failures"] += sum(len(run.keys) for run in saves)
            return
        stack = contextlib.ExitStack()
        slots: list[tuple[int, torch.Tensor]] = []
        try:
            for run in saves:
                write = stack.enter_context(session.namespace.write(list(run.keys)))
                for view, block_id in zip(write.views, run.block_ids, strict=True):
                    if view is not None:  # None: already stored
                        raw = torch.frombuffer(view, dtype=torch.uint8)
                        slots.append((block_id, self._block_planes(raw)))
        except KvtierError as exc:
            with contextlib.suppress(KvtierError):  # abandon what was allocated
                stack.__exit__(type(exc), exc, exc.__traceback__)
            self.counters["save_failures"] += sum(len(run.keys) for run in saves)
            self._link.drop(exc)
            return
        self._saving, self._save_slots = stack, slots

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self._saves_pending:
            self._start_saves()
        if not self._save_slots:
            return
        layer = self._layers[layer_name]
        for block_id, planes in self._save_slots:
            planes[2 * layer : 2 * layer + 2].copy_(self._planes(kv_layer, block_id))

    def wait_for_save(self) -> None:
        self._finish_loads()
        self._saves_pending = False
        stack, self._saving = self._saving, None
        slots, self._save_slots = self._save_slots, []
        if stack is None:
            return
        try:
            stack.close()  # COMMIT every write of the step
            self.counters["saved_blocks"] += len(slots)
        except KvtierError as exc:
            self.counters["save_failures"] += len(slots)
            self._link.drop(exc)

    def _abandon_saves(self) -> None:
        """A step that never reached ``wait_for_save`` (it raised): abandon its writes."""
        stack, self._saving = self._saving, None
        slots, self._save_slots = self._save_slots, []
        if stack is not None:
            error = BrokenConnectionError("the step did not complete")
            with contextlib.suppress(KvtierError):
                stack.__exit__(type(error), error, None)
            self.counters["save_failures"] += len(slots)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._finish_loads()
        self._abandon_saves()
        self._link.close()
