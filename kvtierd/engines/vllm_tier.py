"""kvtierd below vLLM's CPU tier: a ``SecondaryTierManager`` for vLLM's native KV offloading
(``OffloadingConnector`` with ``TieringOffloadingSpec``, vLLM 0.32).

One entry in ``kv_connector_extra_config["secondary_tiers"]`` enables it (:func:`tier_entry`
builds it)::

    {"type": "KvtierdTier", "module_path": "kvtierd.engines.vllm_tier",
     "socket": "/run/kvtierd/kvtierd.sock",   # optional: kvtierd's default socket
     "tenant": "default",                      # optional
     "namespace": "vllm"}                      # optional: the namespace name's prefix

Theory of operation. vLLM calls every method of a secondary tier on its scheduler thread and
requires each to return at once, so the tier only queues work there. The I/O runs on two threads
the tier owns (started by the constructor, joined by :meth:`KvtierdTier.shutdown`), each with a
connection of its own: a blocking client serves one request at a time and a READ waits until
its blocks are up from NVMe, which a lookup must not queue behind.

* **Lookups** follow vLLM's own pattern for tiers that do I/O (``AsyncLookupManager``, which the
  fs tier uses too): a key not asked about yet answers RETRY; at the end of the step the step's
  new keys go to the lookup thread as one batch per request; the scheduler picks up the answers
  at its next lookup. vLLM wants an answer per key: with several KV cache groups a batch holds
  each group's keys in turn, and a sliding-window group's are asked from the end of the prompt
  and held only as the window before some hit, so presence is no prefix of the batch:
  :func:`present` asks with one LOOKUP that answers every key (``Namespace.present``), which
  also starts promoting the NVMe hits into DRAM.
* **Transfers**: one queue, loads before stores. A job's blocks move in batches of at most a
  quarter of the tenant's arena (so a prompt larger than the daemon's DRAM still moves), one
  READ (a lease) or one two-phase write per batch, and one copy per block between the CPU
  tier's slot (a row of ``primary_kv_view``) and the arena.

What the daemon guarantees, and the tier relies on: a block is visible from its COMMIT on,
never before, and an aborted or interrupted write leaves nothing, so a failed store is a failed
job and nothing else. A lease holds verified bytes until it is released, and a block missing
at READ fails that READ (``BlockNotFoundError``): the load job fails (the batches before it stay
loaded), vLLM frees the slots and recomputes; never wrong data. A connection that broke (a
daemon restart) fails what was in flight and is reopened by the next call.

Keys are vLLM's offload keys (the block hash, chained over the prompt from vLLM's
``NONE_HASH``, and the KV group), folded with the namespace's salt into 32 bytes (BLAKE2b).
They are stable across processes with vLLM's default ``sha256`` hashes; ``xxhash`` hashes are
seeded at random per process unless ``PYTHONHASHSEED`` is set, and the tier refuses to run
with those (:func:`refuse_random_block_hashes`). Everything else that decides a block's bytes
is in the namespace: see :func:`namespace_name`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import count
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from kvtierd.client import Namespace
from kvtierd.engines.link import EngineLink, NamespaceSpec
from kvtierd.errors import ConfigError, ConfigProblem, KvtierError

__all__ = [
    "KvtierdTier",
    "TierOptions",
    "TierStatistics",
    "block_key",
    "namespace_name",
    "present",
    "refuse_random_block_hashes",
    "tier_entry",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierOptions:
    """The tier's entry in ``secondary_tiers``, checked."""

    #: The daemon's socket; ``None``: kvtierd's default (``$KVTIERD_SOCKET``, ...).
    socket: str | None = None
    tenant: str = "default"
    #: The namespace name's prefix; the rest of the name is the KV layout's identity.
    namespace: str = "vllm"
    #: Bounds every request to the daemon (a READ includes its NVMe reads).
    timeout_s: float = 60.0
    #: What vLLM's per-request tier filter sees (given as ``"LOCAL"`` or ``"REMOTE"``).
    locality: Locality = Locality.LOCAL

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> TierOptions:
        """Raises :class:`ConfigError` naming every unknown key and bad value."""
        known = {f.name for f in fields(cls)}
        problems = [ConfigProblem(k, "unknown option") for k in sorted(set(entry) - known)]
        values = {k: v for k, v in entry.items() if k in known}

        def check(key: str, ok: Callable[[Any], bool], want: str) -> None:
            if key in values and not ok(values[key]):
                problems.append(ConfigProblem(key, f"must be {want}, not {values[key]!r}"))

        def is_name(v: Any) -> bool:
            return isinstance(v, str) and 0 < len(v) <= 100 and v.isprintable()

        check("socket", lambda v: v is None or (isinstance(v, str) and v != ""), "a path")
        check("tenant", is_name, "a name of 1 to 100 printable characters")
        check("namespace", is_name, "a name of 1 to 100 printable characters")
        check(
            "timeout_s",
            lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v > 0,
            "a positive number of seconds",
        )
        check(
            "locality",
            lambda v: isinstance(v, Locality) or v in {"LOCAL", "REMOTE"},
            "LOCAL or REMOTE",
        )
        if problems:
            raise ConfigError("bad kvtierd entry in secondary_tiers", problems)
        if "locality" in values:
            values["locality"] = Locality(values["locality"])
        return cls(**values)


def tier_entry(
    *,
    socket: str | os.PathLike[str] | None = None,
    tenant: str = "default",
    namespace: str = "vllm",
) -> dict[str, Any]:
    """The ``secondary_tiers`` entry that puts kvtierd below vLLM's CPU tier (JSON-able)."""
    options: dict[str, Any] = {"tenant": tenant, "namespace": namespace}
    if socket is not None:
        options["socket"] = os.fspath(socket)
    TierOptions.from_entry(options)
    return {"type": KvtierdTier.__name__, "module_path": __name__, **options}


def namespace_name(config: OffloadingConfig, block_bytes: int, prefix: str = "vllm") -> str:
    """The kvtierd namespace of vLLM's offloaded blocks: ``prefix/model/dtype/Nt/tpT/digest``.

    The digest covers what vLLM's own fs tier keeps blocks apart by (model, KV dtype, groups
    with their layers and block size, blocks per chunk, TP/PP/CP sizes, replicated and canonical
    layouts) plus the KV cache layout and the bytes per block, so no two of those ever share
    keys. The TP ranks share the name: vLLM's scheduler holds every rank's bytes of a block in
    one CPU-tier row, and a row is one kvtierd block.
    """
    parallel = config.parallel
    identity = {
        "engine": "vllm",
        "model": config.model.name,
        "kv_dtype": config.model.dtype,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in config.groups],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "block_bytes": block_bytes,
        "parallel": [
            parallel.tp_size,
            parallel.pp_size,
            parallel.pcp_size,
            parallel.dcp_size,
            parallel.world_size,
        ],
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout,
    }
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    model = config.model.name.rstrip("/")
    if os.path.isabs(model) or model.startswith("."):
        model = os.path.basename(model)
    tokens = {g.tokens_per_block * config.cache.blocks_per_chunk for g in config.groups}
    size = f"{tokens.pop()}t" if len(tokens) == 1 else "mixed"
    return f"{prefix}/{model[-80:]}/{config.model.dtype}/{size}/tp{parallel.tp_size}/{digest}"


def block_key(offload_key: bytes, salt: bytes) -> bytes:
    """The kvtierd key of one vLLM offload key (36 bytes with sha256 hashes; kvtierd's keys are
    at most 32): keyed BLAKE2b under the namespace's salt, so equal keys still mean equal
    prefixes and only clients of the tenant can compute them."""
    return hashlib.blake2b(offload_key, digest_size=32, key=salt[:64]).digest()


def present(ns: Namespace, keys: Sequence[bytes]) -> list[bool]:
    """Whether each of ``keys`` is stored in ``ns``, in order (``Namespace.present``: one
    LOOKUP of every key)."""
    return ns.present(keys)


def refuse_random_block_hashes() -> None:
    """Raise :class:`ConfigError` when this process's vLLM block hashes are seeded at random
    (``xxhash``/``xxhash_cbor`` without ``PYTHONHASHSEED``): every restart would then be a cold
    cache and everything stored a waste. Returns when they are stable, or not seeded yet and
    vLLM's configuration is not visible (vLLM seeds them after it builds the scheduler)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.v1.core import kv_cache_utils

    if os.environ.get("PYTHONHASHSEED") is not None:
        return
    seed = kv_cache_utils._NONE_HASH_SEED  # None until init_none_hash ran in this process
    if seed is None:
        config = get_current_vllm_config_or_none()
        algorithm = config.cache_config.prefix_caching_hash_algo if config else "sha256"
        random = algorithm.startswith("xxhash")
    else:
        random = seed != kv_cache_utils.DEFAULT_NONE_HASH_SEED
    if random:
        raise ConfigError(
            "vLLM seeds its xxhash block hashes at random per process, so kvtierd could never "
            "serve a block to another engine or after a restart: set PYTHONHASHSEED (the same "
            "value for every engine) or use prefix_caching_hash_algo sha256 or sha256_cbor"
        )


@dataclass(frozen=True)
class TierStatistics:
    """What the tier did since it started (blocks are vLLM CPU-tier chunks)."""

    lookups: int
    lookup_hits: int
    stored_blocks: int
    store_failures: int
    loaded_blocks: int
    load_failures: int
    reconnects: int


def _link(options: TierOptions, role: str) -> EngineLink:
    """One thread's link to the daemon (each of the tier's threads has its own connection)."""
    return EngineLink(
        options.socket,
        client_name=f"kvtierd vLLM tier ({role}) pid {os.getpid()}",
        tenant=options.tenant,
        timeout_s=options.timeout_s,
        log=log,
    )


class _Lookups(AsyncLookupManager):  # type: ignore[misc]  # vLLM is untyped
    """vLLM's lookup state machine; its thread asks the daemon, one LOOKUP per request."""

    def __init__(self, link: EngineLink, spec: NamespaceSpec, tier_type: str) -> None:
        self.link = link
        self._spec = spec
        self.lookups = self.hits = 0
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        try:
            ns = self.link.namespace(self._spec)
            found = present(ns, [block_key(key, ns.key_salt) for key in keys])
        except KvtierError as exc:
            self.link.lost(exc)
            raise  # vLLM logs it and answers MISS for these keys
        self.lookups += 1
        self.hits += sum(found)
        return found


@dataclass(frozen=True)
class _Job:
    job_id: JobId
    keys: tuple[OffloadKey, ...]
    slots: tuple[int, ...]
    load: bool


class _Transfers:
    """The transfer thread: one queue (loads first), one connection, results for the
    scheduler thread to collect."""

    _STOP = -1

    def __init__(self, link: EngineLink, spec: NamespaceSpec, rows: np.ndarray) -> None:
        self.link = link
        self._spec = spec
        self._rows = rows
        self._order = count()
        self._queue: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._results: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self.stored = self.store_failures = self.loaded = self.load_failures = 0
        self._thread = threading.Thread(target=self._serve, name="kvtierd-tier-io", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> None:
        self._queue.put((0 if job.load else 1, next(self._order), job))

    def finished(self) -> list[JobResult]:
        results = []
        with contextlib.suppress(queue.Empty):
            while True:
                results.append(self._results.get_nowait())
        return results

    def drain(self) -> None:
        self._queue.join()

    def close(self) -> None:
        """Stop after the job in progress; queued jobs fail without any I/O."""
        self._queue.put((self._STOP, next(self._order), None))
        self._thread.join()
        with contextlib.suppress(queue.Empty):
            while True:
                _, _, job = self._queue.get_nowait()
                if job is not None:
                    self._results.put(JobResult(job.job_id, success=False))
                self._queue.task_done()
        self.link.close()

    def _serve(self) -> None:
        while True:
            _, _, job = self._queue.get()
            try:
                if job is None:
                    return
                self._results.put(self._run(job))
            finally:
                self._queue.task_done()

    def _run(self, job: _Job) -> JobResult:
        started = time.monotonic()
        block_bytes = self._rows.shape[1]
        done = 0
        try:
            session = self.link.session()
            ns = session.namespace(self._spec)
            keys = [block_key(key, ns.key_salt) for key in job.keys]
            step = max(1, min(ns.client.max_keys, ns.arena.size_bytes // (4 * block_bytes)))
            move = self._read if job.load else self._write
            for start in range(0, len(keys), step):
                end = min(start + step, len(keys))
                session.with_room(
                    functools.partial(move, ns, keys[start:end], job.slots[start:end])
                )
                done = end
        except Exception as exc:  # reported to vLLM as a failed job; the tier goes on
            self.link.lost(exc)
            log.warning("kvtierd tier: %s job %d failed: %r", _kind(job), job.job_id, exc)
            if job.load:
                self.load_failures += 1
            else:
                self.store_failures += 1
            return JobResult(
                job.job_id,
                success=False,
                successful_keys=job.keys[:done] if job.load and done else None,
                transfer_time=time.monotonic() - started,
                transfer_bytes=done * block_bytes,
            )
        if job.load:
            self.loaded += done
        else:
            self.stored += done
        return JobResult(
            job.job_id,
            success=True,
            transfer_time=time.monotonic() - started,
            transfer_bytes=done * block_bytes,
        )

    def _write(self, ns: Namespace, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        with ns.write(keys) as write:
            for view, slot in zip(write.views, slots, strict=True):
                if view is not None:  # None: stored already
                    view[:] = memoryview(self._rows[slot])

    def _read(self, ns: Namespace, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        # Each block is checked as it is copied into its row, in the one pass that copies it
        # (a block changed after COMMIT raises CorruptBlockError, as the lease itself would).
        with ns.lease(keys, verify_on_copy=True) as lease:
            for i, slot in enumerate(slots):
                lease.copy_into(i, self._rows[slot])


def _kind(job: _Job) -> str:
    return "load" if job.load else "store"


class KvtierdTier(SecondaryTierManager):  # type: ignore[misc]  # vLLM is untyped
    """kvtierd as a secondary tier of vLLM's ``TieringOffloadingSpec`` (see the module
    docstring). The constructor takes the entry's options as keywords (:class:`TierOptions`),
    opens the namespace and starts the tier's two threads; a bad entry raises
    :class:`ConfigError`, an unreachable daemon the client's error."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.options = TierOptions.from_entry(options)
        self.locality = self.options.locality
        refuse_random_block_hashes()
        rows = np.asarray(primary_kv_view)
        if rows.ndim != 2:
            raise ValueError(f"primary_kv_view must be [chunks, bytes], not {rows.shape}")
        rows = rows.view(np.uint8)
        self.namespace_name = namespace_name(
            offloading_spec.config, rows.shape[1], self.options.namespace
        )
        spec = NamespaceSpec(self.namespace_name, block_bytes=rows.shape[1])
        lookup_link = _link(self.options, "lookups")
        try:
            lookup_link.namespace(spec)  # a wrong socket or tenant fails the engine's start-up
        except KvtierError as exc:
            where = self.options.socket or "kvtierd's default socket"
            exc.add_note(f"kvtierd vLLM tier: namespace {self.namespace_name!r} at {where}")
            raise
        self._lookups = _Lookups(lookup_link, spec, tier_type)
        try:
            self._transfers = _Transfers(_link(self.options, "transfers"), spec, rows)
        except BaseException:
            self._lookups.shutdown()
            lookup_link.close()
            raise
        self._load_keys: dict[JobId, tuple[OffloadKey, ...]] = {}
        self._hashes_checked = False

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._transfers.submit(_job(job_metadata, load=False))

    def submit_load(self, job_metadata: TransferJob) -> None:
        job = _job(job_metadata, load=True)
        self._load_keys[job.job_id] = job.keys
        self._transfers.submit(job)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = self._transfers.finished()
        for result in results:
            keys = self._load_keys.pop(result.job_id, None)
            if keys is not None and not result.success:
                # Else vLLM would ask again, find the cached HIT and retry for ever.
                loaded = set(result.successful_keys or ())
                self._lookups.mark_miss([key for key in keys if key not in loaded])
        return results

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if not self._hashes_checked:
            refuse_random_block_hashes()  # seeded by now: vLLM seeds before serving
            self._hashes_checked = True
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # the daemon keeps its own recency

    def drain_jobs(self) -> None:
        self._transfers.drain()

    def shutdown(self) -> None:
        try:
            self._lookups.shutdown()
            self._lookups.link.close()
        finally:
            self._transfers.close()

    def statistics(self) -> TierStatistics:
        t = self._transfers
        return TierStatistics(
            lookups=self._lookups.lookups,
            lookup_hits=self._lookups.hits,
            stored_blocks=t.stored,
            store_failures=t.store_failures,
            loaded_blocks=t.loaded,
            load_failures=t.load_failures,
            reconnects=sum(max(0, link.opens - 1) for link in (self._lookups.link, t.link)),
        )


def _job(job: TransferJob, *, load: bool) -> _Job:
    return _Job(job.job_id, tuple(job.keys), tuple(int(s) for s in job.chunk_ids), load)
