"""Typed frame bodies, one request and one reply struct per opcode, encoded as MessagePack.

Bodies are ``msgspec`` structs encoded ``array_like`` (a MessagePack array of the fields in
order), which is compact and fast to decode. Every field is bounded by a ``Meta`` constraint, so
a decoded message is already validated: a body that does not match its opcode's struct, or
breaks a bound, is rejected by the decoder with ``EINVAL`` before any handler sees it.

Compatibility rule: fields are only ever appended, with defaults, and never reordered; a
change that breaks that needs a new ``PROTOCOL_VERSION``. A peer rejects an array longer than
the struct it knows, so a field appended to a reply after the oldest client minor a daemon
serves is left out for a client whose INIT said an older minor (:data:`APPENDED`,
``encode_body(..., peer_minor=)``).

The module is past 600 lines because it is the protocol's whole vocabulary, a request and a
reply per opcode with every bound, in one place that reads side by side with
``docs/protocol.md``; splitting it by opcode would scatter the compatibility table.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

from kvtierd.errors import InvalidRequestError
from kvtierd.keys import MAX_KEY_BYTES
from kvtierd.protocol.frames import MAX_KEYS_PER_REQUEST, MIN_MAX_FRAME_BYTES, Opcode

__all__ = [
    "APPENDED",
    "APPENDED_REQUEST_FIELDS",
    "MAX_QUEUE_KEYS",
    "MAX_SELECTED_BYTES",
    "REPLY_TYPES",
    "REQUEST_TYPES",
    "AllocReply",
    "AllocRequest",
    "CommitReply",
    "CommitRequest",
    "ConfigReply",
    "ConfigRequest",
    "DestroyReply",
    "DestroyRequest",
    "DoctorReply",
    "DoctorRequest",
    "ErrorReply",
    "EvictReply",
    "EvictRequest",
    "Extent",
    "ForgetReply",
    "ForgetRequest",
    "FsyncReply",
    "FsyncRequest",
    "HintReply",
    "HintRequest",
    "HostCheckRecord",
    "InitReply",
    "InitRequest",
    "KeyRecord",
    "Layout",
    "ListKeysReply",
    "ListKeysRequest",
    "ListNsReply",
    "ListNsRequest",
    "LookupReply",
    "LookupRequest",
    "Message",
    "NamespaceInfo",
    "NixlGrantReply",
    "NixlGrantRequest",
    "OpenNsReply",
    "OpenNsRequest",
    "PoolStatusReply",
    "PoolStatusRequest",
    "ReadNixlReply",
    "ReadNixlRequest",
    "ReadReply",
    "ReadRequest",
    "ReadResidentReply",
    "ReadResidentRequest",
    "ReleaseReply",
    "ReleaseRequest",
    "StatfsReply",
    "StatfsRequest",
    "TenantStatistics",
    "TierStatistics",
]

U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFF_FFFF)]
FrameLimit = Annotated[int, msgspec.Meta(ge=MIN_MAX_FRAME_BYTES, le=0xFFFF_FFFF)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack uint64; msgspec bounds stop at int64
Positive = Annotated[int, msgspec.Meta(ge=1, le=0xFFFF_FFFF_FFFF)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
ShortText = Annotated[str, msgspec.Meta(max_length=255)]
Key = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Keys = Annotated[list[Key], msgspec.Meta(min_length=1, max_length=MAX_KEYS_PER_REQUEST)]
Session = Annotated[bytes, msgspec.Meta(max_length=64)]


class Message(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Base of every body."""


# -- INIT -----------------------------------------------------------------------------------


class InitRequest(Message, frozen=True):
    major: U32
    minor: U32
    max_frame_bytes: U32
    client_name: ShortText = ""


class InitReply(Message, frozen=True):
    """No memory travels with INIT (minor 6): a tenant's region is passed at OPEN_NS, once the
    peer is admitted to it; ``arena_bytes`` is 0.

    ``max_frame_bytes`` is the negotiated limit on request frames, never below
    ``MIN_MAX_FRAME_BYTES`` (so an INIT always fits).
    """

    major: U32
    minor: U32
    max_frame_bytes: FrameLimit
    max_inflight: U32
    max_keys: U32
    arena_bytes: U64
    daemon_version: ShortText


# -- namespaces -----------------------------------------------------------------------------


class Layout(Message, frozen=True):
    """How a block's bytes are laid out; part of the namespace identity."""

    model_id: Name
    layers: Positive
    kv_heads: Positive
    head_dim: Positive
    dtype: Name
    block_tokens: Positive
    order: Name = "layer-major"


class OpenNsRequest(Message, frozen=True):
    name: Name
    block_bytes: Positive
    layout: Layout | None = None
    rank: U32 = 0
    world_size: Positive = 1
    tenant: Name = "default"
    compression: Name = "none"
    #: ``False``: answer ``ENOENT`` instead of creating a namespace that does not exist yet.
    create: bool = True
    #: Summarise committed blocks so HINT can rank them for query vectors (needs ``layout``).
    sparse: bool = False


class OpenNsReply(Message, frozen=True):
    """``ns`` goes into later request headers; ``key_salt`` seeds ``chain_keys``. The
    namespace's blocks live in DRAM region ``region`` of ``region_bytes``; every reply carries
    that region's descriptor (``FrameFlags.FD_ATTACHED``), which a client maps once."""

    ns: U32
    key_salt: bytes
    digest: bytes
    region: U32 = 0
    region_bytes: U64 = 0


class ListNsRequest(Message, frozen=True):
    pass


class NamespaceInfo(Message, frozen=True):
    ns: U32
    name: str
    tenant: str
    rank: int
    world_size: int
    block_bytes: int
    dram_blocks: int
    nvme_blocks: int
    layout: Layout | None = None
    #: Minor 7: its blocks in any tier (a block in DRAM and on disk counts once), and what its
    #: clients asked for and got since the daemon started.
    blocks: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    committed_blocks: int = 0
    committed_bytes: int = 0


class ListNsReply(Message, frozen=True):
    namespaces: list[NamespaceInfo]


class ListKeysRequest(Message, frozen=True):
    """LIST_KEYS (minor 7): a page of namespace ``ns``'s keys (its id in LIST_NS, open on this
    connection or not), in byte order, starting after ``after`` (``b""``: from the first)."""

    ns: Annotated[int, msgspec.Meta(ge=1, le=0xFFFF_FFFF)]
    after: Annotated[bytes, msgspec.Meta(max_length=MAX_KEY_BYTES)] = b""
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_KEYS_PER_REQUEST)] = 1024


class KeyRecord(Message, frozen=True):
    """One stored key: which tiers hold a copy, its size as committed, and whether its disk
    copy is still to be written (``dirty``)."""

    key: bytes
    dram: bool
    nvme: bool
    pool: bool
    raw_bytes: int
    dirty: bool


class ListKeysReply(Message, frozen=True):
    """``keys`` in byte order; ``more``: keys after the last one exist (ask again with it as
    ``after``); ``blocks``: the namespace's blocks now."""

    keys: list[KeyRecord]
    more: bool = False
    blocks: int = 0


# -- blocks ---------------------------------------------------------------------------------


class Extent(Message, frozen=True):
    """A block's place in its namespace's region: ``offset`` and ``length`` in bytes, xxh3-64
    ``checksum`` of the committed bytes (a reader checks what it copies against it)."""

    offset: U64
    length: U64
    checksum: U64 = 0


class LookupRequest(Message, frozen=True):
    """``each`` (minor 10): answer every key, not only the leading hits."""

    keys: Keys
    promote: bool = True
    each: bool = False


class LookupReply(Message, frozen=True):
    """``hits`` leading keys are present; ``tiers[i]`` is the tier of hit ``i`` (0 dram, 1 nvme,
    2 pool). With ``each``, ``tiers`` has a code for every key, 3 (a miss) for one not stored."""

    hits: U32
    tiers: bytes = b""


class ReadRequest(Message, frozen=True):
    keys: Keys


class ReadReply(Message, frozen=True):
    lease: U64
    extents: list[Extent]


class ReadResidentRequest(Message, frozen=True):
    """READ_RESIDENT (minor 4): lease the leading keys that are in DRAM now; never waits."""

    keys: Keys


class ReadResidentReply(ReadReply, frozen=True):
    """READ's reply (its own type, so each opcode has one); ``extents`` may be fewer than the
    keys (none: ``lease`` 0, nothing to RELEASE)."""


class NixlGrantRequest(Message, frozen=True):
    """NIXL_GRANT (minor 8): the NIXL agent metadata of the region of the header's namespace
    (which must be open on this connection)."""


#: NIXL's metadata of one registration with its connection info is a few KiB; a reply that
#: claims more than this is not one.
MAX_NIXL_METADATA_BYTES = 1 << 20


class NixlGrantReply(Message, frozen=True):
    """``agent`` is the NIXL agent name of the region's exporter (a process of the daemon's
    that maps that region alone; a new name after it restarts), ``region`` the tenant region
    the metadata names (its registration alone), ``metadata`` what the client's agent loads."""

    agent: Name
    region: U32
    metadata: Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_NIXL_METADATA_BYTES)]


class ReadNixlRequest(Message, frozen=True):
    """READ_NIXL (minor 8): READ, with the NIXL descriptors of the leased blocks."""

    keys: Keys


class ReadNixlReply(Message, frozen=True):
    """READ's ``lease`` and ``extents``, and ``descriptors``: the blocks' bytes (each
    ``extents[i].length`` long, in key order) as the region's exporter agent describes them
    (:mod:`kvtierd.nixl.descriptors`)."""

    lease: U64
    extents: list[Extent]
    descriptors: bytes


class ReleaseRequest(Message, frozen=True):
    leases: Annotated[list[U64], msgspec.Meta(min_length=1, max_length=MAX_KEYS_PER_REQUEST)]


class ReleaseReply(Message, frozen=True):
    released: U32


class AllocRequest(Message, frozen=True):
    keys: Keys


class AllocReply(Message, frozen=True):
    write: U64
    extents: list[Extent]


class CommitRequest(Message, frozen=True):
    """Publish (or with ``abort`` drop) the blocks of an ALLOC. ``checksums``, when given, are
    the client's xxh3-64 of each block; the daemon checks them against the arena bytes."""

    write: U64
    checksums: Annotated[list[U64], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)] = []
    abort: bool = False


class CommitReply(Message, frozen=True):
    committed: U32


class ForgetRequest(Message, frozen=True):
    keys: Keys


class ForgetReply(Message, frozen=True):
    forgotten: U32


class EvictRequest(Message, frozen=True):
    """Drop the DRAM copies of clean blocks (of the header's namespace, or of all)."""

    all_namespaces: bool = False


class EvictReply(Message, frozen=True):
    evicted: U32


class FsyncRequest(Message, frozen=True):
    pass


class FsyncReply(Message, frozen=True):
    durable_blocks: U64


#: Keys in all of a HINT's queued chains together: the bound of every other request's keys, so
#: that no request makes the daemon walk more keys than a LOOKUP does.
MAX_QUEUE_KEYS: Final = MAX_KEYS_PER_REQUEST
#: A sparse HINT's selection in its reply (``HintReply.selected``: 4 bytes per query layer, KV
#: head and block of the budget) is at most this, half of a client's default frame, so that the
#: reply always reaches it: the library refuses to ask for more, and the daemon answers a
#: larger request with the ranked keys alone, as before minor 14.
MAX_SELECTED_BYTES: Final = 512 << 10


class HintRequest(Message, frozen=True):
    """What the engine knows about the future. ``queue`` lists the key chains of queued
    requests, first to be scheduled first (at most :data:`MAX_QUEUE_KEYS` keys in all);
    ``session`` names the conversation.

    Raises :class:`~kvtierd.errors.InvalidRequestError` (a ``ValueError``, which the decoder
    turns into a validation error, so ``EINVAL`` on the wire) for a longer queue.
    """

    session: Session = b""
    queue: Annotated[list[Keys], msgspec.Meta(max_length=256)] = []
    #: Sparse attention: the sequence's key chain, in order (block i = position i) ...
    chain: Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)] = []
    #: ... the decode step's float32 post-RoPE queries, C order, of shape ``query_shape``
    #: ``[len(query_layers), q_heads, head_dim]`` (or with a steps axis before head_dim) ...
    queries: Annotated[bytes, msgspec.Meta(max_length=1 << 20)] = b""
    query_shape: Annotated[list[U32], msgspec.Meta(max_length=4)] = []
    query_layers: Annotated[list[U32], msgspec.Meta(max_length=1024)] = []
    #: ... and how many blocks to keep per (layer, KV head).
    budget_blocks: U32 = 0
    #: (minor 14) The most of the ranked, then the predicted blocks to start promoting: an
    #: engine that reads only the best of the ranking (one selection for every layer) asks
    #: for no more; 0 promotes all of both. (The chain's unsummarised blocks, up to 256, are
    #: promoted besides, to be summarised.)
    promote_blocks: U32 = 0

    def __post_init__(self) -> None:
        queued = sum(len(keys) for keys in self.queue)
        if queued > MAX_QUEUE_KEYS:
            raise InvalidRequestError(
                f"the queue holds {queued} keys in all; at most {MAX_QUEUE_KEYS} per HINT"
            )


class HintReply(Message, frozen=True):
    planned: U32 = 0
    #: Sparse attention: the chain's blocks to keep, best first; those to have on their way
    #: for the next step.
    ranked: list[bytes] = []
    predicted: list[bytes] = []
    #: (minor 14) ... and the selection itself, per (layer, KV head): little-endian int32 chain
    #: positions ``[len(query_layers) * kv_heads, budget]``, row ``i * kv_heads + h`` for layer
    #: ``query_layers[i]`` and KV head ``h``, forced blocks first, then best first, -1 padding
    #: a row when the chain is shorter than the budget (``budget``: the request's
    #: ``budget_blocks``, at most the chain's length).
    selected: bytes = b""


# -- daemon ---------------------------------------------------------------------------------


class StatfsRequest(Message, frozen=True):
    pass


class TierStatistics(Message, frozen=True):
    name: str
    blocks: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    bytes_read: int
    bytes_written: int
    #: (minor 13) Bytes of the blocks counted in ``misses``.
    miss_bytes: int = 0


class TenantStatistics(Message, frozen=True):
    """(minor 11) One DRAM region's tenant (``""``: the region of the tenants not listed) and
    what its namespaces hold and did since the daemon started."""

    tenant: str
    namespaces: int
    dram_blocks: int
    dram_used_bytes: int
    dram_capacity_bytes: int
    nvme_blocks: int
    nvme_used_bytes: int
    dram_hits: int
    nvme_hits: int
    pool_hits: int
    misses: int
    dram_evictions: int
    bytes_read: int
    bytes_committed: int


class StatfsReply(Message, frozen=True):
    version: str
    uptime_s: float
    io_backend: str
    connections: int
    requests: int
    namespaces: int
    leases: int
    leased_blocks: int
    pending_writes: int
    dirty_blocks: int
    dirty_bytes: int
    durable_blocks: int
    promotions: int
    prefetch_promoted: int
    prefetch_used: int
    prefetch_wasted_bytes: int
    tiers: list[TierStatistics]
    #: ``"host"`` (the admin's view) or ``"tenant"``: the figures of the caller's tenants only.
    scope: str = "host"
    sparse_summaries: int = 0
    sparse_summary_bytes: int = 0
    #: Blocks dropped because their tenant changed them after COMMIT.
    corrupt_writebacks: int = 0
    #: Sparse summaries dropped to stay within ``limits.sparse_summary_bytes``.
    sparse_summaries_dropped: int = 0
    #: (minor 9) The NVMe tier's index checkpoints: ``"on"``, ``"off"`` (no NVMe tier, or
    #: ``nvme.checkpoint_every_bytes = 0``) or ``"given up: <why>"`` for the rest of the run
    #: (a crash restart then scans every header). Host scope only; a tenant sees ``"off"``.
    checkpoints: str = "off"
    #: Checkpoints written since the daemon started.
    checkpoints_written: int = 0
    #: Seconds since the last one was written; ``-1.0`` when none was in this run.
    checkpoint_age_s: float = -1.0
    #: Bytes written to the NVMe tier since the last checkpoint was begun: what a crash
    #: restart scans beyond it is the segments these went to.
    bytes_since_checkpoint: int = 0
    #: The longest the event loop was held by one slice of a checkpoint's copy, in seconds.
    checkpoint_longest_slice_s: float = 0.0
    #: (minor 11) Each DRAM region's tenant: every region for the admin, the caller's listed
    #: tenants' for a tenant (``scope = "tenant"``).
    tenants: list[TenantStatistics] = []
    #: (minor 15) Sparse indices being clustered in the background now: until theirs is done,
    #: a session's HINTs score every block of its chain.
    sparse_fits: int = 0


class PoolStatusRequest(Message, frozen=True):
    pass


class PoolStatusReply(Message, frozen=True):
    """Where this daemon stands with the shared pool (``state`` "none": no pool configured)."""

    state: str
    reason: str = ""
    address: str = ""
    group: str = ""
    rank: int = 0
    world_size: int = 1
    write_policy: str = ""
    epoch: int = 0
    members: list[int] = []
    refusals: dict[int, str] = {}
    changed_at: float = 0.0
    backlog_blocks: int = 0
    backlog_bytes: int = 0
    unreached: int = 0
    restored: int = 0
    written: int = 0
    write_failures: int = 0
    skipped: int = 0
    lost: int = 0
    group_lookups: int = 0
    pool_hits: int = 0


class DoctorRequest(Message, frozen=True):
    pass


class HostCheckRecord(Message, frozen=True):
    """One line of the daemon's report on its host: ``status`` is ok, fallback or fail."""

    subject: ShortText
    status: ShortText
    detail: Annotated[str, msgspec.Meta(max_length=4096)]


class DoctorReply(Message, frozen=True):
    """What the host gives the daemon and what it fell back from (``kvtierctl doctor``)."""

    checks: list[HostCheckRecord]


class ConfigRequest(Message, frozen=True):
    pass


class ConfigReply(Message, frozen=True):
    """(minor 12) The configuration the daemon runs (``kvtierctl config``): where it came from,
    its digest (SHA-256 hex of its canonical form), every field as a TOML configuration file,
    and the fields that differ from the daemon's defaults."""

    source: Annotated[str, msgspec.Meta(max_length=4096)]
    digest: Annotated[str, msgspec.Meta(max_length=64)]
    toml: str
    changed: list[Annotated[str, msgspec.Meta(max_length=255)]]


class DestroyRequest(Message, frozen=True):
    pass


class DestroyReply(Message, frozen=True):
    pass


class ErrorReply(Message, frozen=True):
    """Body of every reply whose header carries a negative errno."""

    message: str = ""


REQUEST_TYPES: Final[dict[Opcode, type[Message]]] = {
    Opcode.INIT: InitRequest,
    Opcode.OPEN_NS: OpenNsRequest,
    Opcode.LOOKUP: LookupRequest,
    Opcode.READ: ReadRequest,
    Opcode.RELEASE: ReleaseRequest,
    Opcode.ALLOC: AllocRequest,
    Opcode.COMMIT: CommitRequest,
    Opcode.FORGET: ForgetRequest,
    Opcode.FSYNC: FsyncRequest,
    Opcode.HINT: HintRequest,
    Opcode.STATFS: StatfsRequest,
    Opcode.DESTROY: DestroyRequest,
    Opcode.LIST_NS: ListNsRequest,
    Opcode.EVICT: EvictRequest,
    Opcode.POOL_STATUS: PoolStatusRequest,
    Opcode.DOCTOR: DoctorRequest,
    Opcode.CONFIG: ConfigRequest,
    Opcode.READ_RESIDENT: ReadResidentRequest,
    Opcode.LIST_KEYS: ListKeysRequest,
    Opcode.NIXL_GRANT: NixlGrantRequest,
    Opcode.READ_NIXL: ReadNixlRequest,
}

REPLY_TYPES: Final[dict[Opcode, type[Message]]] = {
    Opcode.INIT: InitReply,
    Opcode.OPEN_NS: OpenNsReply,
    Opcode.LOOKUP: LookupReply,
    Opcode.READ: ReadReply,
    Opcode.RELEASE: ReleaseReply,
    Opcode.ALLOC: AllocReply,
    Opcode.COMMIT: CommitReply,
    Opcode.FORGET: ForgetReply,
    Opcode.FSYNC: FsyncReply,
    Opcode.HINT: HintReply,
    Opcode.STATFS: StatfsReply,
    Opcode.DESTROY: DestroyReply,
    Opcode.LIST_NS: ListNsReply,
    Opcode.EVICT: EvictReply,
    Opcode.POOL_STATUS: PoolStatusReply,
    Opcode.DOCTOR: DoctorReply,
    Opcode.CONFIG: ConfigReply,
    Opcode.READ_RESIDENT: ReadResidentReply,
    Opcode.LIST_KEYS: ListKeysReply,
    Opcode.NIXL_GRANT: NixlGrantReply,
    Opcode.READ_NIXL: ReadNixlReply,
}

OPCODE_OF: Final[dict[type[Message], Opcode]] = {
    **{cls: op for op, cls in REQUEST_TYPES.items()},
    **{cls: op for op, cls in REPLY_TYPES.items()},
}

#: Reply structs that grew after minor 6 (the oldest client a daemon serves): struct -> each
#: (minor that appended fields, how many it had before), oldest first. A peer of an older
#: minor is sent the struct without them.
APPENDED: Final[dict[type[Message], tuple[tuple[int, int], ...]]] = {
    NamespaceInfo: ((7, 9),),
    TierStatistics: ((13, 9),),  # miss_bytes
    StatfsReply: (
        (9, 22),  # the disk tier's checkpoints
        (11, 27),  # the tenants
        (15, 28),  # sparse_fits
    ),
    HintReply: ((14, 3),),  # selected
}
#: The bodies that hold such a struct (or are one), each with the newest minor that appended
#: any of what it holds: a peer of that minor or newer is sent the body as it is.
_HOLDERS: Final[dict[type[Message], int]] = {
    ListNsReply: max(since for since, _ in APPENDED[NamespaceInfo]),
    StatfsReply: max(since for cls in (StatfsReply, TierStatistics) for since, _ in APPENDED[cls]),
    HintReply: max(since for since, _ in APPENDED[HintReply]),
}
#: Request structs that grew after minor 6: struct -> how many fields it had before. The
#: appended fields are sent only up to the last one that differs from its default, so a
#: request that does not use them is the bytes an older daemon decodes (minor 10:
#: ``LookupRequest.each``).
APPENDED_REQUEST_FIELDS: Final[dict[type[Message], int]] = {LookupRequest: 2, HintRequest: 7}
_APPENDED_DEFAULTS: Final[dict[type[Message], tuple[Any, ...]]] = {
    cls: tuple(f.default for f in msgspec.structs.fields(cls)[before:])
    for cls, before in APPENDED_REQUEST_FIELDS.items()
}

_ENCODER: Final = msgspec.msgpack.Encoder()
_BODY_TYPES: Final[list[type[Message]]] = [*OPCODE_OF, ErrorReply]
_DECODERS: Final[dict[type[Message], msgspec.msgpack.Decoder[Any]]] = {
    cls: msgspec.msgpack.Decoder(cls) for cls in _BODY_TYPES
}


def encode_body(message: Message, *, peer_minor: int | None = None) -> bytes:
    """MessagePack bytes of ``message``; for a peer of ``peer_minor`` (what its INIT said)
    without the fields appended after that minor (:data:`APPENDED`)."""
    if peer_minor is not None and peer_minor < _HOLDERS.get(type(message), 0):
        return _ENCODER.encode(_as_of(message, peer_minor))
    before = APPENDED_REQUEST_FIELDS.get(type(message))
    if before is not None:  # a request's appended fields: up to the last one not at its default
        fields = msgspec.structs.astuple(message)
        defaults = _APPENDED_DEFAULTS[type(message)]
        sent = len(fields)
        while sent > before and fields[sent - 1] == defaults[sent - 1 - before]:
            sent -= 1
        return _ENCODER.encode(fields[:sent])
    return _ENCODER.encode(message)


def _as_of(value: Any, minor: int) -> Any:
    """``value`` as arrays of the fields a peer of ``minor`` knows (the bytes of the struct)."""
    if isinstance(value, Message):
        fields = msgspec.structs.astuple(value)
        known = next(
            (before for since, before in APPENDED.get(type(value), ()) if minor < since),
            len(fields),
        )
        return [_as_of(v, minor) for v in fields[:known]]
    if isinstance(value, list):
        return [_as_of(v, minor) for v in value]
    return value


def decode_body(cls: type[Message], data: bytes | memoryview) -> Message:
    """Decode ``data`` as ``cls``; raises ``msgspec.ValidationError``/``DecodeError`` only."""
    try:
        result: Message = _DECODERS[cls].decode(data)
    except UnicodeDecodeError as exc:
        # msgspec lets a MessagePack str that is not UTF-8 escape as UnicodeDecodeError; the
        # connections treat only msgspec's errors as a bad body, so translate it here.
        raise msgspec.DecodeError(f"a string is not valid UTF-8: {exc.reason}") from exc
    return result
