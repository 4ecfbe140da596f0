"""Hypothesis strategies for every protocol body, derived from the structs themselves.

``message_strategy(cls)`` reads the struct's fields with ``msgspec.inspect`` and draws values that
respect every ``msgspec.Meta`` bound (lengths, ``ge``/``le``), so a new field or a changed bound in
``kvtierd/protocol/messages.py`` is picked up without touching the tests. Lists are drawn short
(the suite must stay fast); the bounds themselves are checked by example in ``test_limits``.
"""

from __future__ import annotations

import os
import struct
from functools import cache
from typing import Any

import msgspec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kvtierd.protocol import HEADER_BYTES, PROTOCOL_VERSION, Opcode
from kvtierd.protocol.frames import REPLY_MAGIC, REQUEST_MAGIC
from kvtierd.protocol.messages import REPLY_TYPES, REQUEST_TYPES, Message

__all__ = [
    "FAST",
    "MAX_DRAWN_ITEMS",
    "THOROUGH",
    "garbage",
    "message_strategy",
    "reply_frames",
    "reply_pairs",
    "request_frames",
    "requests",
]

#: Longest list drawn for any list field (the real bounds are up to 8192).
MAX_DRAWN_ITEMS = 4
_INT64_MIN = -(1 << 63)
_UINT64_MAX = (1 << 64) - 1  # the widest integer MessagePack carries
_MAX_TEXT = 40

#: Settings for the properties: moderate, because CI has two cores and the whole protocol suite
#: must stay well under a minute. No deadline: a cold start or a busy machine is not a failure.
FAST = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
#: For the fuzzers: more examples. ``KVTIERD_FUZZ_EXAMPLES=20000`` turns them into a soak run.
THOROUGH = settings(
    max_examples=int(os.environ.get("KVTIERD_FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _ints(info: msgspec.inspect.IntType) -> st.SearchStrategy[int]:
    low = _INT64_MIN if info.ge is None else info.ge
    high = _UINT64_MAX if info.le is None else info.le
    if info.gt is not None:
        low = max(low, info.gt + 1)
    if info.lt is not None:
        high = min(high, info.lt - 1)
    # Edges first: they are where encodings change width (fixint, uint8, ... uint64).
    edges = [
        v for v in (low, high, 0, 127, 128, 255, 256, 65535, 65536, 1 << 32) if low <= v <= high
    ]
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


def _length(min_length: int | None, max_length: int | None, cap: int) -> tuple[int, int]:
    low = min_length or 0
    high = cap if max_length is None else min(max_length, max(cap, low))
    return low, high


def _for_type(info: msgspec.inspect.Type) -> st.SearchStrategy[Any]:
    if isinstance(info, msgspec.inspect.IntType):
        return _ints(info)
    if isinstance(info, msgspec.inspect.BoolType):
        return st.booleans()
    if isinstance(info, msgspec.inspect.FloatType):
        return st.floats(allow_nan=False)
    if isinstance(info, msgspec.inspect.StrType):
        assert info.pattern is None, "no wire string has a pattern yet; teach the strategy"
        low, high = _length(info.min_length, info.max_length, _MAX_TEXT)
        long_text = [] if info.max_length is None else [st.just("é" * info.max_length)]
        return st.one_of(st.text(min_size=low, max_size=high), *long_text)
    if isinstance(info, msgspec.inspect.BytesType):
        low, high = _length(info.min_length, info.max_length, 64)
        return st.binary(min_size=low, max_size=high)
    if isinstance(info, msgspec.inspect.ListType):
        low, high = _length(info.min_length, info.max_length, MAX_DRAWN_ITEMS)
        return st.lists(_for_type(info.item_type), min_size=low, max_size=high)
    if isinstance(info, msgspec.inspect.DictType):
        low, high = _length(info.min_length, info.max_length, MAX_DRAWN_ITEMS)
        return st.dictionaries(
            _for_type(info.key_type), _for_type(info.value_type), min_size=low, max_size=high
        )
    if isinstance(info, msgspec.inspect.UnionType):
        return st.one_of(*(_for_type(t) for t in info.types))
    if isinstance(info, msgspec.inspect.NoneType):
        return st.none()
    if isinstance(info, msgspec.inspect.StructType):
        return message_strategy(info.cls)
    raise NotImplementedError(f"no strategy for {info!r}: extend tests/protocol/strategies.py")


@cache
def message_strategy(cls: type[Message]) -> st.SearchStrategy[Message]:
    """Valid instances of ``cls``; optional fields are sometimes left at their defaults."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in info.fields:
        (fields if field.required else optional)[field.name] = _for_type(field.type)
    return st.fixed_dictionaries(fields, optional=optional).map(lambda kw: cls(**kw))


#: A request of any opcode.
requests: st.SearchStrategy[Message] = st.one_of(
    *(message_strategy(cls) for cls in REQUEST_TYPES.values())
)


@st.composite
def reply_pairs(draw: st.DrawFn) -> tuple[Message, Message]:
    """``(request, reply)`` of one opcode."""
    opcode = draw(st.sampled_from(sorted(REPLY_TYPES)))
    return draw(message_strategy(REQUEST_TYPES[opcode])), draw(
        message_strategy(REPLY_TYPES[opcode])
    )


def garbage(magic: bytes) -> st.SearchStrategy[bytes]:
    """Bytes that cannot start a frame: their first byte already differs from ``magic``."""
    return st.binary(min_size=1, max_size=64).filter(lambda b: b[0] != magic[0])


def _frame(magic: bytes, fields: st.SearchStrategy[tuple[int, ...]], fmt: str) -> Any:
    packer = struct.Struct(fmt)

    @st.composite
    def frames(draw: st.DrawFn) -> bytes:
        body = draw(
            st.one_of(st.binary(max_size=48), message_strategy_any.map(msgspec.msgpack.encode))
        )
        opcode, flags_or_error, unique, ns_or_flags = draw(fields)
        length = draw(
            st.one_of(st.just(HEADER_BYTES + len(body)), st.integers(0, HEADER_BYTES + 64))
        )
        version = draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 2, 0xFFFF]))
        header = packer.pack(magic, version, opcode, length, flags_or_error, unique, ns_or_flags, 0)
        return header + body

    return frames()


message_strategy_any: st.SearchStrategy[Message] = st.deferred(
    lambda: st.one_of(
        *(message_strategy(cls) for cls in {*REQUEST_TYPES.values(), *REPLY_TYPES.values()})
    )
)

_OPCODES = st.one_of(st.sampled_from([int(op) for op in Opcode]), st.integers(0, 0xFFFF))

#: Request frames with a sound magic and mostly sound lengths, but any opcode, unique id,
#: version and body: they reach the state machine and the body decoder, which pure noise does
#: not.
request_frames = _frame(
    REQUEST_MAGIC,
    st.tuples(_OPCODES, st.integers(0, 3), st.integers(0, 6), st.integers(0, 4)),
    "<4sHHIIQII",
)

#: Reply frames likewise, with errors from 0 and the known errnos to anything.
reply_frames = _frame(
    REPLY_MAGIC,
    st.tuples(
        _OPCODES,
        st.one_of(st.sampled_from([0, -2, -22, -71, 5]), st.integers(-(1 << 31), (1 << 31) - 1)),
        st.integers(0, 6),
        st.integers(0, 3),
    ),
    "<4sHHIiQII",
)
