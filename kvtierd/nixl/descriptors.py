"""What an owner tells a puller about its memory: whose extents, and which (no NIXL, no I/O).

NIXL's own descriptor serialisation is ``pickle``: a puller would run whatever its peer sent. An
owner's extents travel as one MessagePack array instead, ``[FORMAT, agent, [[address, length],
...]]``, decoded into a typed struct that refuses anything else (trailing bytes, a wrong format,
a non-positive address or length).

The owner describes only extents that lie wholly inside memory it registered (one registration,
when it describes for one tenant's client); the puller checks that the descriptors are the
peer's and pair, length for length, with its own registered extents. Neither check is a security
boundary: a puller can hand NIXL any extent it likes (and edit the metadata its NIXL checks
them against), and over UCX nothing on the owner's side refuses one (``docs/nixl.md``). They
keep kvtierd's own callers honest; what a client can reach at all is bounded by the process it
reads from (one exporter per tenant region, :mod:`kvtierd.nixl.exporter`), and which blocks it
may read by its lease, re-checked on completion.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvtierd.errors import InvalidRequestError

__all__ = ["FORMAT", "Descriptors", "Extent", "agent_of", "check_within", "decode", "encode"]

#: ``(address, length)`` of bytes in one process.
Extent = tuple[int, int]
#: The first element of every encoding; a change of layout takes the next number.
FORMAT = 1
#: The widest unsigned integer MessagePack carries; no extent may end past it.
_ADDRESS_LIMIT = 1 << 64


class Descriptors(msgspec.Struct, frozen=True, array_like=True):
    """Extents of ``agent``'s registered memory, as :func:`encode` writes them."""

    format: int
    agent: str
    extents: tuple[tuple[int, int], ...]


def check_within(extents: Sequence[Extent], ranges: Sequence[Extent], *, what: str) -> None:
    """Raise :class:`~kvtierd.errors.InvalidRequestError` unless ``extents`` is not empty and
    each extent has a positive address and length and lies wholly inside one of ``ranges``."""
    if not extents:
        raise InvalidRequestError(f"no {what} extents")
    for address, length in extents:
        if address <= 0 or length <= 0 or address + length > _ADDRESS_LIMIT:
            raise InvalidRequestError(f"{what} extent {length} bytes at {address:#x} is invalid")
        if not any(base <= address and address + length <= base + n for base, n in ranges):
            raise InvalidRequestError(
                f"{what} extent {length} bytes at {address:#x} is outside registered memory"
            )


def encode(agent: str, extents: Sequence[Extent], registered: Sequence[Extent]) -> bytes:
    """``extents`` of ``agent``'s memory as bytes for a peer; each must lie inside one of the
    ``registered`` ranges (:class:`~kvtierd.errors.InvalidRequestError` otherwise)."""
    check_within(extents, registered, what="described")
    pairs = tuple((int(address), int(length)) for address, length in extents)
    return msgspec.msgpack.encode(Descriptors(FORMAT, agent, pairs))


def _decoded(data: bytes) -> Descriptors:
    try:
        described = msgspec.msgpack.decode(data, type=Descriptors)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidRequestError(f"not NIXL descriptors: {exc}") from exc
    if described.format != FORMAT:
        raise InvalidRequestError(f"NIXL descriptors of format {described.format}, not {FORMAT}")
    return described


def agent_of(data: bytes) -> str:
    """The agent whose memory the :func:`encode`\\ d ``data`` describes (a daemon's exporter
    that was restarted has a new one); :class:`~kvtierd.errors.InvalidRequestError` for
    anything that is not descriptors."""
    return _decoded(data).agent


def decode(data: bytes, *, peer: str, local: Sequence[Extent]) -> Descriptors:
    """The :func:`encode`\\ d extents of ``peer``, checked to pair with ``local`` (as many, each
    as long); :class:`~kvtierd.errors.InvalidRequestError` for anything else."""
    described = _decoded(data)
    if described.agent != peer:
        raise InvalidRequestError(f"descriptors of {described.agent!r}, not of {peer!r}")
    if any(address <= 0 or length <= 0 for address, length in described.extents):
        raise InvalidRequestError("NIXL descriptors with a non-positive address or length")
    if [n for _, n in described.extents] != [n for _, n in local]:
        raise InvalidRequestError("remote and local extents differ in number or length")
    return described
