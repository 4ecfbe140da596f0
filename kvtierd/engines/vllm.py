"""kvtierd under vLLM: a ``KVConnectorBase_V1`` connector (vLLM 0.32, V1 engine).

Enable it with::

    LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="KvtierdConnector",
        kv_connector_module_path="kvtierd.engines.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"socket": "/run/kvtierd/kvtierd.sock"},  # optional
    ))

vLLM builds two instances. The **scheduler** side answers ``get_num_new_matched_tokens`` from
one LOOKUP of the request's block keys; while hits are still coming up from NVMe it answers
"ask again" instead of waiting, then leases the DRAM-resident hits (READ_RESIDENT: no eviction
can take what vLLM was promised) until the worker reports them loaded. The **worker** side
loads from the arena into vLLM's paged KV tensors: on a GPU layer by layer (one copy per layer
and block, overlapping the forward; each block hashed when leased, since the copy is DMA), into
a host (CPU) cache at once, each block copied into every layer's planes and hashed in the same
pass (``BlockLease.copy_into``, the planes' byte runs as scatter targets). It saves a step's
completed prompt blocks with the two-phase write: arena slots allocated at the first layer,
each layer's K and V copied in as vLLM writes them, committed after the step (abandoned, never
visible, if anything fails or a layer was never written). A block that vanished between lookup
and load, or that fails its checksum (changed after COMMIT by a client of the tenant), is
reported to vLLM as a load error (with ``kv_load_failure_policy="recompute"`` vLLM recomputes
it), and the request saves nothing more: blocks computed over a failed load would be wrong.

**KV cache groups.** A model with sliding-window layers (Gemma 3) has several KV cache groups
under vLLM's hybrid manager, one block table each. The connector declares ``SupportsHMA`` and
keeps each group's blocks in a namespace of its own (``vllm_link.namespace_name``), so each
has its own keys; a sliding-window group stores and restores only the blocks inside the window
the computation after a hit reads, exactly those vLLM's own prefix hit keeps, and a prefix is
a hit only when every group has what it needs (``vllm_groups``). vLLM cannot map a block-level
load error back to a request when there are several groups, so such an engine loads every hit
before the forward (the asynchronous path) and reports a failed load as the request's
(``failed_recving``): vLLM recomputes it whole, and the connector offers it nothing more.

Keys are kvtierd's chain keys over the prompt's token ids, not vLLM's block hashes: those depend
on an engine setting (``prefix_caching_hash_algo``: the ``xxhash`` ones are seeded at random per
process unless ``PYTHONHASHSEED`` is set) and on vLLM's internal format, so another setting or
a vLLM upgrade would strand everything kvtierd holds. What changes the KV besides the tokens
keeps keys apart: model, quantisation, KV dtype and shape, block size, TP size and rank, and the
backend's K/V format are in the namespace (:mod:`kvtierd.engines.vllm_link`), the request's
``cache_salt`` and LoRA adapter in each key's salt. Requests with multimodal inputs or prompt
embeddings are neither looked up nor saved. See ``docs/engines.md`` ("vLLM").

*Why one module past 600 lines:* it is one class, the connector vLLM loads by name, whose two
sides share its state; what it does not need to hold is already elsewhere (the planning in
``vllm_plan``, each group's needs in ``vllm_groups``, the groups and namespaces in
``vllm_link``, the connection in :mod:`kvtierd.engines.link`, the host cache's byte runs in
``host_runs``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvtierd.client import BlockLease, BlockWrite, Namespace
from kvtierd.client.arena import copy_verified
from kvtierd.engines.host_runs import HostRuns
from kvtierd.engines.link import EngineLink, NamespaceSpec, Session
from kvtierd.engines.vllm_groups import KvGroup
from kvtierd.engines.vllm_link import (
    UnsupportedEngineError,
    cache_groups,
    kv_format,
    namespace_name,
)
from kvtierd.engines.vllm_plan import (
    BlockRun,
    ConnectorSettings,
    Promotion,
    RequestPlan,
    loadable_blocks,
)
from kvtierd.errors import (
    BlockNotFoundError,
    KvtierError,
    NoSpaceError,
    QuotaError,
    is_connection_loss,
)
from kvtierd.keys import chain_keys
from kvtierd.protocol.messages import Extent

__all__ = [
    "KvtierdConnector",
    "KvtierdConnectorMetadata",
    "KvtierdWorkerMetadata",
    "UnsupportedEngineError",
    "cache_groups",
    "namespace_name",
]

log = logging.getLogger("kvtierd.vllm")


@dataclass
class KvtierdConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is untyped
    """What one step asks of the worker: runs of blocks to load and to save, and the requests
    that finished (the worker forgets them)."""

    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)


@dataclass
class KvtierdWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]  # vLLM is untyped
    """What the workers tell the scheduler after a step: requests whose loads are done (their
    DRAM leases can go)."""

    loaded: set[str] = field(default_factory=set)

    def aggregate(self, other: Any) -> KvtierdWorkerMetadata:
        return KvtierdWorkerMetadata(self.loaded | getattr(other, "loaded", set()))


@dataclass
class _Load:
    """A run being loaded layer by layer: its lease, where its blocks go and the arena (held
    here, so a session replaced meanwhile cannot take the mapping away)."""

    request_id: str
    lease: BlockLease
    block_ids: tuple[int, ...]
    arena: torch.Tensor
    group: int = 0


def _tp_position(vllm_config: Any, role: KVConnectorRole) -> tuple[int, int]:
    world = int(vllm_config.parallel_config.tensor_parallel_size)
    if role != KVConnectorRole.WORKER or world == 1:
        return 0, world
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), world


class KvtierdConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]  # vLLM is untyped
    """kvtierd as vLLM's KV connector (see the module docstring)."""

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer hooks must run on every forward: a replayed full CUDA graph skips them.
        return True

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra(
            dict(self._kv_transfer_config.kv_connector_extra_config or {})
        )
        self.cache = cache_groups(vllm_config, kv_cache_config, self.settings.model_id)
        self._block_tokens = self.cache.block_tokens
        groups = self.cache.groups
        #: Several groups: vLLM cannot take block-level load errors, so loads go before the
        #: forward and a failure fails the request's load (module docstring).
        self._grouped = len(groups) > 1
        rank, world = _tp_position(vllm_config, role)
        settings = self.settings
        self._link = EngineLink(
            settings.socket,
            client_name="vllm",
            tenant=settings.tenant,
            timeout_s=settings.timeout_s,
            log=log,
        )
        hybrid = self._grouped or groups[0].windowed
        self._specs = tuple(
            NamespaceSpec(
                _namespace(settings.namespace, group, world, tagged=hybrid),
                layout=group.layout,
                rank=rank,
                world_size=world,
            )
            for group in groups
        )
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning(
                "kv_load_failure_policy is %r: a kvtierd block lost between lookup and load "
                'fails the request; set kv_load_failure_policy="recompute" to recompute it',
                self._kv_transfer_config.kv_load_failure_policy,
            )
        # scheduler side
        self._plans: dict[str, RequestPlan] = {}
        self._leases: dict[str, list[BlockLease]] = {}
        self._promotions: dict[str, Promotion] = {}
        self._offered_nothing: set[str] = set()  # their load failed (grouped engines)
        self._null_block: int | None = None  # vLLM's placeholder for skipped blocks
        # worker side
        #: Each layer's group and place in it.
        self._layers: dict[str, tuple[int, int]] = {
            name: (group.index, i) for group in groups for i, name in enumerate(group.layer_names)
        }
        self._kv: dict[str, torch.Tensor] = {}
        self._device: torch.device | None = None
        #: Per group: its layers' KV caches, by place in the group.
        self._kv_by_layer: list[list[tuple[int, torch.Tensor]]] = [[] for _ in groups]
        self._one_pass = False
        #: Per group, per layer of a host cache: its storage's bytes, block 0's runs there, a
        #: tile's bytes.
        self._block_spans: list[list[tuple[memoryview, list[tuple[int, int]], int]]] = []
        self._cpu_format = False
        self._session: Session | None = None  # the step's, fixed at bind
        self._loading: list[_Load] = []
        self._loaded: set[str] = set()
        self._received: set[str] = set()  # loaded before the forward, for get_finished
        self._failed_loads: set[str] = set()  # of those, failed (grouped engines)
        self._tainted: set[str] = set()  # a load failed: save nothing more of these
        self._waited: set[str] = set()  # layers the step's layer-by-layer loads reached
        self._saves_pending = False
        #: The step's writes (allocated at its first layer), each with its namespace.
        self._saving: list[tuple[Namespace, BlockWrite]] | None = None
        #: Per group: the vLLM block and the arena slot's planes of each block being saved.
        self._save_slots: list[list[tuple[int, torch.Tensor]]] = []
        self._saved_layers: set[str] = set()
        self._load_errors: set[int] = set()
        self._step_error: KvtierError | None = None

    # -- scheduler side ----------------------------------------------------------------------

    def _ns(self, session: Session, group: int = 0) -> Namespace:
        """Group ``group``'s namespace on ``session``."""
        return session.namespace(self._specs[group])

    def _request_keys(self, request: Any, session: Session) -> tuple[tuple[bytes, ...], ...]:
        """The prompt's full-block keys, per group (each under its namespace's salt)."""
        groups = range(len(self.cache.groups))
        if request.mm_features or getattr(request, "prompt_embeds", None) is not None:
            return tuple(() for _ in groups)
        tokens = request.prompt_token_ids or []
        extra = b""
        if request.cache_salt:
            extra += b"|salt:" + request.cache_salt.encode()
        if request.lora_request is not None:
            extra += b"|lora:" + request.lora_request.lora_name.encode()
        return tuple(
            tuple(chain_keys(tokens, self._block_tokens, self._ns(session, g).key_salt + extra))
            for g in groups
        )

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._drop_lease(request.request_id)
        no_hit: tuple[int | None, bool] = (0, False)
        if request.request_id in self._offered_nothing:
            return no_hit  # its load failed: vLLM computes it
        return self._link.call(
            "lookup", lambda session: self._match(request, num_computed_tokens, session), no_hit
        )

    def _match(
        self, request: Any, num_computed_tokens: int, session: Session
    ) -> tuple[int | None, bool]:
        """:meth:`get_num_new_matched_tokens` on ``session``; a ``KvtierError`` is a miss."""
        req_id = request.request_id
        bt = self._block_tokens
        plan = self._plans.get(req_id)
        if plan is None:
            keys = self._request_keys(request, session)
            prompt = len(request.prompt_token_ids or [])
            plan = RequestPlan(req_id, prompt, keys, self.cache, self._null_block)
            self._plans[req_id] = plan
        local = num_computed_tokens // bt
        # By default load what vLLM's own hit would hold (every block ending before the last
        # prompt token), and vLLM computes the rest; with ``whole_prompt`` (opt-in) a prompt
        # of whole blocks kvtierd holds entirely is loaded whole before the forward (vLLM's
        # asynchronous path), and vLLM computes only the last token.
        top = loadable_blocks(plan.prompt_tokens, bt, before_forward=self.settings.whole_prompt)
        stored, tiers = self._lookup(plan, local, top, session)
        if stored <= local:
            plan.promise(local, stored)
            return 0, False
        before_forward = self._grouped or stored > loadable_blocks(plan.prompt_tokens, bt)
        resident = sum(next((i for i, t in enumerate(g) if t != "dram"), len(g)) for g in tiers)
        if resident < sum(map(len, tiers)):
            # Hits still coming up from NVMe (LOOKUP started promoting them): ask again next
            # step rather than wait, while DRAM keeps filling with them.
            now = time.monotonic()
            promotion = self._promotions.setdefault(
                req_id, Promotion(now, self.settings.wait_for_promotion_s)
            )
            if promotion.ask_again(resident, now):
                return None, False
        self._hold(plan, local, stored, session)
        self._promotions.pop(req_id, None)
        # Every hit is promised; those not in DRAM now the worker reads itself.
        promised = plan.promise(local, stored, before_forward=before_forward)
        return promised * bt, before_forward and promised > 0

    def _lookup(
        self, plan: RequestPlan, local: int, top: int, session: Session
    ) -> tuple[int, list[list[str]]]:
        """The longest hit of at most ``top`` blocks for which every group has what it needs
        (LOOKUPs of the blocks past vLLM's ``local`` ones), and the tiers of each group's
        needed blocks; a hit that shrank between the LOOKUPs is no hit."""
        found: dict[int, tuple[int, list[str]]] = {}

        def stored(group: KvGroup, start: int, stop: int) -> int:
            keys = plan.keys[group.index][start:stop]
            tiers = self._ns(session, group.index).lookup_tiers(keys) if keys else []
            found[group.index] = (start, tiers)
            return len(tiers)

        hit = self.cache.longest_hit(top, local, plan.prompt_tokens, stored)
        every: list[list[str]] = []
        for group in self.cache.groups:
            start = self.cache.needed(group, hit, plan.prompt_tokens, beyond=local).start
            first, tiers = found.get(group.index, (-1, []))
            if first != start or len(tiers) < hit - start:
                stored(group, start, hit)
                tiers = found[group.index][1]
                if len(tiers) < hit - start:
                    return local, []
            every.append(tiers[: hit - start])
        return hit, every

    def _hold(self, plan: RequestPlan, local: int, hit: int, session: Session) -> None:
        """Lease the hit's DRAM-resident blocks of every group until the worker has read them
        (no eviction can take them meanwhile); the worker verifies what it copies, so hashing
        them here too would be a second pass over every block for nothing."""
        leases: list[BlockLease] = []
        try:
            for group in self.cache.groups:
                start = self.cache.needed(group, hit, plan.prompt_tokens, beyond=local).start
                keys = plan.keys[group.index][start:hit]
                if keys:
                    ns = self._ns(session, group.index)
                    leases.append(ns.acquire(keys, resident_only=True, verify_on_copy=True))
        except BaseException:
            for lease in leases:
                lease.release()
            raise
        held = [lease for lease in leases if lease.keys]
        for lease in leases:
            if not lease.keys:
                lease.release()
        if held:
            self._leases[plan.request_id] = held

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None:
            return
        plan.allocated(blocks.get_block_ids(), num_external_tokens, self._block_tokens)
        if num_external_tokens == 0:
            self._drop_lease(request.request_id)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._null_block = int(gpu_block_pool.null_block.block_id)

    def build_connector_meta(self, scheduler_output: Any) -> KvtierdConnectorMetadata:
        meta = KvtierdConnectorMetadata(finished=set(scheduler_output.finished_req_ids or ()))
        for req_id in scheduler_output.preempted_req_ids or ():
            self._drop_lease(req_id)  # its blocks are gone; a resume asks again
        for waiting in self._plans.values():  # loads before the forward: not scheduled yet
            if waiting.load_before_forward:
                meta.loads += waiting.take_load()
        bt = self._block_tokens
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            plan = self._plans.get(new.req_id)
            if plan is None:
                continue
            plan.block_ids = [list(ids) for ids in new.block_ids]
            self._plan_step(meta, plan, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self._plans.get(req_id)
            if plan is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                plan.block_ids = [list(ids) for ids in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                for ids, more in zip(plan.block_ids, new_ids, strict=True):
                    ids.extend(more)
            done = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            if done <= plan.prompt_tokens + bt:  # decoding past the prompt saves nothing
                self._plan_step(meta, plan, done)
        return meta

    def _plan_step(self, meta: KvtierdConnectorMetadata, plan: RequestPlan, done: int) -> None:
        meta.loads += plan.take_load()
        meta.saves += plan.take_save(done, self._block_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        worker = getattr(connector_output, "kv_connector_worker_meta", None)
        for req_id in getattr(worker, "loaded", ()):
            self._drop_lease(req_id)  # loaded: what the lease protected is in vLLM's memory
        # A grouped engine's load that failed: vLLM computes the request whole (with the
        # "recompute" policy) and asks again; offer it nothing more.
        self._offered_nothing.update(getattr(connector_output, "failed_recving", None) or ())

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        req_id = request.request_id
        self._plans.pop(req_id, None)
        self._promotions.pop(req_id, None)
        self._offered_nothing.discard(req_id)
        self._drop_lease(req_id)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        return self.request_finished(request, block_ids)

    def _drop_lease(self, req_id: str) -> None:
        for lease in self._leases.pop(req_id, ()):
            lease.release()

    # -- worker side: copies -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, tensor in kv_caches.items():
            if name not in self._layers:
                raise UnsupportedEngineError(f"vLLM layer {name!r} is in no KV cache group")
            lo = self.cache.groups[self._layers[name][0]].layout
            want = (lo.kv_heads, lo.block_tokens, 2 * lo.head_dim)
            if tuple(tensor.shape[1:]) != want or tensor.dtype != getattr(torch, lo.dtype):
                raise UnsupportedEngineError(
                    f"{name}: KV cache {tuple(tensor.shape)} {tensor.dtype}, expected "
                    f"[blocks, {want[0]}, {want[1]}, {want[2]}] {lo.dtype} (kernel blocks "
                    "smaller than vLLM's blocks are not supported)"
                )
        self._kv = dict(kv_caches)
        # A block id names one block of one group: the groups' layers share vLLM's tensors,
        # each group's blocks taken from one pool.
        self._kv_by_layer = [[] for _ in self.cache.groups]
        for name, tensor in kv_caches.items():
            group, place = self._layers[name]
            self._kv_by_layer[group].append((place, tensor))
        for layers in self._kv_by_layer:
            layers.sort(key=lambda pair: pair[0])
        #: Where the KV cache lives when not on the host: the arena is pinned for it.
        self._device = next((t.device for t in kv_caches.values() if t.device.type != "cpu"), None)
        #: A host cache holding every layer of a block: loads are copied at once, each block
        #: into all its layers' planes, hashed in the pass that copies it.
        #: (vLLM's CPU format: a block's planes are runs of a whole head's tokens, not of
        #: one token's head_dim, so the runs are few).
        self._cpu_format = kv_format() == "cpu"
        every_layer = all(
            [place for place, _ in layers] == list(range(group.layout.layers))
            for group, layers in zip(self.cache.groups, self._kv_by_layer, strict=True)
        )
        self._one_pass = self._device is None and every_layer and self._cpu_format
        self._block_spans = []
        if self._one_pass:
            host_runs = HostRuns()
            for index, layers in enumerate(self._kv_by_layer):
                spans_of_group = []
                for _, tensor in layers:
                    storage, spans = host_runs.spans(self._planes(tensor, 0, index))
                    tile = tensor.stride(0) * tensor.element_size()
                    spans_of_group.append((storage, spans, tile))
                self._block_spans.append(spans_of_group)

    def _planes(self, tensor: torch.Tensor, block_id: int, group: int) -> torch.Tensor:
        """vLLM block ``block_id`` of one layer of ``group`` as ``[2, kv_heads, block_tokens,
        head_dim]`` (K then V, kvtierd's layer-major planes) over vLLM's ``[H, N, C]`` tile: the
        CPU kernel splits it as ``[H, 2N, D]`` (K rows then V rows per head), GPU backends as
        ``[H, N, K|V]``."""
        tile = tensor[block_id]
        lo = self.cache.groups[group].layout
        h, n, d = lo.kv_heads, lo.block_tokens, lo.head_dim
        if self._cpu_format:
            return tile.view(h, 2, n, d).permute(1, 0, 2, 3)
        return tile.view(h, n, 2, d).permute(2, 0, 1, 3)

    def _block_planes(self, raw: torch.Tensor, group: int) -> torch.Tensor:
        lo = self.cache.groups[group].layout
        shape = (2 * lo.layers, lo.kv_heads, lo.block_tokens, lo.head_dim)
        return raw.view(getattr(torch, lo.dtype)).view(shape)

    def _extent_planes(self, arena: torch.Tensor, extent: Extent, group: int) -> torch.Tensor:
        return self._block_planes(arena[extent.offset : extent.offset + extent.length], group)

    # -- worker side: a step -----------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self._end_step()  # a step that raised before wait_for_save
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KvtierdConnectorMetadata)
        self._tainted -= connector_metadata.finished
        self._saves_pending = bool(connector_metadata.saves)
        if connector_metadata.loads or connector_metadata.saves:
            # One session for the whole step: it is never replaced while the step copies.
            try:
                self._session = self._link.session()
            except KvtierError as exc:  # the step loads nothing (load errors) and saves nothing
                self._link.missed("step", exc, None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # vLLM calls this before the forward when the step has loads, after it otherwise.
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierdConnectorMetadata)
        for run in meta.loads:
            if run.before_forward:
                self._load_before_forward(run)
            else:
                self._start_load(run)

    def _load_before_forward(self, run: BlockRun) -> None:
        """Copy the run's blocks now, every layer at once (vLLM schedules the request once
        :meth:`get_finished` reports it)."""
        got, session = 0, self._session
        self._loaded.add(run.request_id)
        self._received.add(run.request_id)
        if session is not None and self._step_error is None:
            try:
                got = self._load_in_batches(session, run, batch=len(run.keys))
            except KvtierError as exc:
                self._fail_step(exc)
        self._not_loaded(run, got)

    def _start_load(self, run: BlockRun) -> None:
        """Lease the run's blocks for the layer-by-layer copy; a run larger than this
        connection may pin is copied now, in batches; what cannot be read is a load error."""
        got, session = 0, self._session
        self._loaded.add(run.request_id)
        if session is not None and self._step_error is None:
            try:
                if self._one_pass:  # a host cache: copied now, verified as it is copied
                    got = self._load_in_batches(session, run, batch=len(run.keys))
                    self._not_loaded(run, got)
                    return
                ns = self._ns(session, run.group)
                try:
                    lease = ns.acquire(list(run.keys))
                except BlockNotFoundError:  # one is gone: take what is still in DRAM
                    lease = ns.acquire(list(run.keys), resident_only=True)
                except (QuotaError, NoSpaceError):  # more than DRAM lets one connection hold
                    got = self._load_in_batches(session, run)
                else:
                    got = len(lease.keys)
                    arena = session.arena(ns, self._device)
                    load = _Load(run.request_id, lease, run.block_ids[:got], arena, run.group)
                    self._loading.append(load)
            except KvtierError as exc:
                self._fail_step(exc)
        self._not_loaded(run, got)

    def _not_loaded(self, run: BlockRun, got: int) -> None:
        """Blocks ``got ..`` of ``run`` could not be read: load errors for vLLM (with several
        groups, the request's load failed), and the request saves nothing more (what it
        computes attends over them)."""
        if got < len(run.keys):
            if self._grouped:
                self._failed_loads.add(run.request_id)
            else:
                self._load_errors.update(run.block_ids[got:])
            self._tainted.add(run.request_id)

    def _load_in_batches(self, session: Session, run: BlockRun, *, batch: int = 0) -> int:
        """Copy the run's blocks, every layer at once, a batch at a time (halving the batch
        while the daemon refuses it); returns how many leading blocks were copied. A batch
        with a block gone from every tier loads the part of it still in DRAM, then stops."""
        done, batch = 0, max(1, batch or len(run.keys) // 2)
        host, ns = self._one_pass, self._ns(session, run.group)
        while done < len(run.keys):
            keys, complete = list(run.keys[done : done + batch]), True
            try:
                lease = ns.acquire(keys, verify_on_copy=host)
            except (QuotaError, NoSpaceError):
                if batch == 1:
                    return done
                batch //= 2
                continue
            except BlockNotFoundError:  # one is gone (or failed its checksum): what precedes
                complete = False
                try:
                    lease = ns.acquire(keys, resident_only=True, verify_on_copy=host)
                except (QuotaError, NoSpaceError):
                    return done
            with lease:
                block_ids = run.block_ids[done : done + len(lease.keys)]
                if host:
                    copied = self._copy_verified(session, lease, block_ids, run.group)
                else:  # the lease was verified when taken
                    arena = session.arena(ns, self._device)
                    self._copy_layers(arena, lease, block_ids, run.group)
                    copied = len(lease.keys)
            done += copied
            if not complete or copied < len(keys):
                return done
        return done

    def _copy_verified(
        self, session: Session, lease: BlockLease, block_ids: Sequence[int], group: int
    ) -> int:
        """Copy leased blocks into vLLM's host KV cache, each hashed in the pass that copies it
        (every layer's K and V planes filled in block order, the scatter form of
        ``copy_into``); returns how many leading blocks were intact. The first block that
        fails (changed after COMMIT) is a miss, and so are those after it: the bytes the
        failed copy left in its vLLM block are never reported loaded."""
        for i, block_id in enumerate(block_ids):
            # copy_verified, not copy_into: the runs are byte views already, 180 of them per
            # block for SmolLM2, and checking each again costs about a tenth of the copy
            extent = lease.extents[i]
            runs = self._host_runs_of(block_id, group)
            if not copy_verified(lease.views[i], runs, extent.checksum):
                log.warning(
                    "kvtierd load: block %s failed its checksum in DRAM (changed after commit "
                    "by a client of its tenant): a miss",
                    bytes(lease.keys[i]).hex(),
                )
                session.client.corrupt_reads += 1
                return i
        return len(block_ids)

    def _host_runs_of(self, block_id: int, group: int) -> list[memoryview]:
        """Where vLLM block ``block_id`` of ``group`` lives in the host cache, as the byte runs
        a kvtierd block fills in order (layer by layer, K then V): block 0's runs, found once
        per layer (:meth:`register_kv_caches`), moved by ``block_id`` tiles."""
        runs: list[memoryview] = []
        for storage, spans, tile in self._block_spans[group]:
            shift = block_id * tile
            runs += [storage[start + shift : stop + shift] for start, stop in spans]
        return runs

    def _copy_layers(
        self, arena: torch.Tensor, lease: BlockLease, block_ids: Sequence[int], group: int
    ) -> None:
        """Copy leased (verified) blocks layer by layer with torch (a GPU cache: the copy is
        DMA from the pinned arena, which kvtierd cannot hash as it goes)."""
        for extent, block_id in zip(lease.extents, block_ids, strict=False):
            planes = self._extent_planes(arena, extent, group)
            for place, tensor in self._kv_by_layer[group]:
                self._planes(tensor, block_id, group).copy_(planes[2 * place : 2 * place + 2])
        self._sync_copies()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loading:
            return
        group, place = self._layers[layer_name]
        tensor = self._kv[layer_name]
        for load in self._loading:
            if load.group != group:
                continue
            for extent, block_id in zip(load.lease.extents, load.block_ids, strict=False):
                src = self._extent_planes(load.arena, extent, group)[2 * place : 2 * place + 2]
                self._planes(tensor, block_id, group).copy_(src, non_blocking=True)
        self._waited.add(layer_name)
        if len(self._waited) == len(self._layers):
            self._finish_loads()

    def _sync_copies(self) -> None:
        if self._device is not None:  # copies read the arena until they complete
            torch.cuda.current_stream().synchronize()

    def _finish_loads(self) -> None:
        loading, self._loading = self._loading, []
        self._waited = set()
        if loading:
            self._sync_copies()
        for load in loading:
            load.lease.release()

    def _start_saves(self) -> None:
        """Allocate the step's save slots (ALLOC), at its first layer; requests whose load
        failed save nothing (what they compute attends over blocks that were not loaded)."""
        self._saves_pending = False
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierdConnectorMetadata)
        saves = [run for run in meta.saves if run.request_id not in self._tainted]
        session = self._session
        if not saves or session is None or self._step_error is not None:
            return
        writes: list[tuple[Namespace, BlockWrite]] = []
        slots: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.cache.groups]
        try:
            for run in saves:
                ns = self._ns(session, run.group)
                write = ns.allocate(list(run.keys))
                writes.append((ns, write))
                for view, block_id in zip(write.views, run.block_ids, strict=True):
                    if view is not None:  # None: already stored
                        raw = torch.frombuffer(view, dtype=torch.uint8)
                        slots[run.group].append((block_id, self._block_planes(raw, run.group)))
        except KvtierError as exc:  # refused (no room): nothing of this step is saved
            self._abandon(writes)
            self._fail_step(exc)
            return
        self._saving, self._save_slots = writes, slots
        self._saved_layers = set()

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        if self._saves_pending:
            self._start_saves()
        if not self._save_slots:
            return
        group, place = self._layers[layer_name]
        for block_id, planes in self._save_slots[group]:
            planes[2 * place : 2 * place + 2].copy_(self._planes(kv_layer, block_id, group))
        self._saved_layers.add(layer_name)

    def wait_for_save(self) -> None:
        self._finish_loads()
        self._saves_pending = False
        saving, self._saving = self._saving, None
        if saving is not None:
            if len(self._saved_layers) == len(self._layers):
                self._commit(saving)
            else:  # a layer never written: committing would publish stale bytes
                self._abandon(saving)
        self._save_slots = []
        self._end_step()

    def _commit(self, writes: list[tuple[Namespace, BlockWrite]]) -> None:
        """COMMIT every write of the step, in order; after a failure the rest are abandoned."""
        for i, (ns, write) in enumerate(writes):
            try:
                ns.commit(write)
            except KvtierError as exc:
                self._abandon(writes[i + 1 :])
                self._fail_step(exc)
                return

    @staticmethod
    def _abandon(writes: list[tuple[Namespace, BlockWrite]]) -> None:
        for ns, write in writes:
            with contextlib.suppress(KvtierError):
                ns.abort(write)

    def _fail_step(self, exc: KvtierError) -> None:
        """Remember the step's first error; a broken connection is dropped once the step's
        copies are done (never while they still read the session's arena)."""
        if self._step_error is None:
            self._step_error = exc
        if not is_connection_loss(exc):
            log.info("kvtierd refused a request: %s", exc)

    def _end_step(self) -> None:
        self._finish_loads()
        saving, self._saving = self._saving, None
        if saving is not None:
            self._abandon(saving)
        self._save_slots, self._saves_pending = [], False
        session, self._session = self._session, None
        error, self._step_error = self._step_error, None
        if error is not None and session is not None:
            self._link.lost(error, session)  # dropped now that its copies are done

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, set[str] | None]:
        received, self._received = self._received, set()
        return None, received or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """:meth:`get_finished`'s loads, those that failed among them as ``failed_recving``
        (a grouped engine's failed load: vLLM recomputes the request)."""
        results = super().get_transfer_results(finished_req_ids)
        failed, self._failed_loads = self._failed_loads, set()
        results.failed_recving = failed & results.finished_recving
        return results

    def build_connector_worker_meta(self) -> KvtierdWorkerMetadata | None:
        loaded, self._loaded = self._loaded, set()
        return KvtierdWorkerMetadata(loaded) if loaded else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._end_step()
        self._link.close()


def _namespace(prefix: str | None, group: KvGroup, world_size: int, *, tagged: bool) -> str:
    """Group ``group``'s namespace name: the connector's ``namespace`` setting when given,
    else :func:`namespace_name`; a group of a hybrid cache adds its tag to either."""
    if prefix is None:
        return namespace_name(group.layout, world_size, kv_format(), group if tagged else None)
    return f"{prefix}/{group.tag()}" if tagged else prefix
