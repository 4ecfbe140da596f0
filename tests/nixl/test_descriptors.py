"""The descriptors an owner hands a puller: pure code, tested without NIXL."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtierd.errors import InvalidRequestError
from kvtierd.nixl import descriptors
from kvtierd.nixl.descriptors import FORMAT, Descriptors, Extent

REGION: Extent = (0x7F00_0000_0000, 8 << 20)
BASE, SIZE = REGION


@st.composite
def extents_in(draw: st.DrawFn, region: Extent = REGION) -> list[Extent]:
    """One to eight extents wholly inside ``region``."""
    base, size = region
    out = []
    for _ in range(draw(st.integers(1, 8))):
        offset = draw(st.integers(0, size - 1))
        length = draw(st.integers(1, size - offset))
        out.append((base + offset, length))
    return out


@given(extents_in(), st.text(min_size=1, max_size=40))
def test_described_extents_round_trip(extents: list[Extent], agent: str) -> None:
    data = descriptors.encode(agent, extents, [REGION])
    decoded = descriptors.decode(data, peer=agent, local=[(1, n) for _, n in extents])
    assert decoded == Descriptors(FORMAT, agent, tuple(extents))


@given(extents_in())
def test_every_truncation_and_any_trailing_bytes_are_refused(extents: list[Extent]) -> None:
    data = descriptors.encode("owner", extents, [REGION])
    local = [(1, n) for _, n in extents]
    for cut in range(len(data)):
        with pytest.raises(InvalidRequestError):
            descriptors.decode(data[:cut], peer="owner", local=local)
    with pytest.raises(InvalidRequestError, match="trailing"):
        descriptors.decode(data + b"\x00", peer="owner", local=local)


@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_invalid_request(data: bytes) -> None:
    """Whatever arrives, the only failure is :class:`InvalidRequestError`."""
    with contextlib.suppress(InvalidRequestError):
        descriptors.decode(data, peer="owner", local=[(1, 1)])


@pytest.mark.parametrize(
    "extent",
    [
        (BASE + SIZE - 3072, 4096),  # reaches past the region's end
        (BASE - 1, 2),  # starts before it
        (BASE + SIZE, 1),  # just after it
        (BASE, 0),
        (0, 4096),
        (-4096, 4096),
    ],
)
def test_an_owner_describes_nothing_outside_what_it_registered(extent: Extent) -> None:
    with pytest.raises(InvalidRequestError):
        descriptors.encode("owner", [(BASE, 4096), extent], [REGION])


def test_an_extent_spanning_two_registrations_is_refused() -> None:
    """Two adjacent regions (two tenants') are two registrations: no extent crosses from one
    into the other, even where their bytes touch."""
    second = (BASE + SIZE, SIZE)
    descriptors.encode("owner", [(BASE, SIZE), second], [REGION, second])
    with pytest.raises(InvalidRequestError, match="outside"):
        descriptors.encode("owner", [(BASE + SIZE - 10, 20)], [REGION, second])


def test_nothing_to_describe_is_refused() -> None:
    with pytest.raises(InvalidRequestError):
        descriptors.encode("owner", [], [REGION])


def test_descriptors_of_another_agent_are_refused() -> None:
    data = descriptors.encode("owner", [(BASE, 4096)], [REGION])
    with pytest.raises(InvalidRequestError, match="not of 'impostor'"):
        descriptors.decode(data, peer="impostor", local=[(1, 4096)])


@pytest.mark.parametrize("local", [[(1, 4095)], [(1, 4096), (1, 1)], []])
def test_descriptors_that_do_not_pair_with_the_local_extents_are_refused(
    local: list[Extent],
) -> None:
    data = descriptors.encode("owner", [(BASE, 4096)], [REGION])
    with pytest.raises(InvalidRequestError, match="differ"):
        descriptors.decode(data, peer="owner", local=local)


@pytest.mark.parametrize(
    "body",
    [
        [FORMAT + 1, "owner", [[BASE, 4096]]],
        [FORMAT, "owner", [[0, 4096]]],
        [FORMAT, "owner", [[BASE, -1]]],
        [FORMAT, "owner", [[BASE, 4096, 0]]],
        {"format": FORMAT, "agent": "owner", "extents": [[BASE, 4096]]},
    ],
)
def test_other_encodings_are_refused(body: object) -> None:
    with pytest.raises(InvalidRequestError):
        descriptors.decode(msgspec.msgpack.encode(body), peer="owner", local=[(1, 4096)])


def test_the_encoding_is_a_plain_msgpack_array() -> None:
    """Not pickle: any MessagePack reader sees ``[format, agent, [[address, length]]]``."""
    data = descriptors.encode("owner", [(BASE, 4096)], [REGION])
    assert msgspec.msgpack.decode(data) == [FORMAT, "owner", [[BASE, 4096]]]
