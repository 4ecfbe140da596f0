"""The kept-DRAM image (:mod:`kvtierd.store.kept`): what decodes, and the verification each
adopted block passes."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import xxhash

from kvtierd.store import kept
from kvtierd.store.kept import (
    IMAGE_VERSION,
    DramImage,
    KeptBlock,
    KeptRegion,
    decode_image,
    encode_image,
    verify_blocks,
)


def test_an_image_round_trips() -> None:
    image = DramImage(
        IMAGE_VERSION,
        time.time(),
        os.getpid(),
        [KeptRegion(1, None, 2 << 20, False, 7, 8, 3)],
        [KeptBlock(1, 4096, 8192, b"d" * 16, b"k" * 16, 8000, 123, 9, False)],
    )
    assert decode_image(encode_image(image)) == image


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"version": IMAGE_VERSION}),
        msgspec.msgpack.encode(
            {"version": IMAGE_VERSION + 1, "written_at": 0.0, "pid": 1, "regions": [], "blocks": []}
        ),
        msgspec.msgpack.encode(
            {"version": IMAGE_VERSION, "written_at": 0.0, "pid": 1, "regions": [[1]], "blocks": []}
        ),
    ],
)
def test_anything_but_an_image_of_this_version_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_image(data)


def test_an_image_past_the_bound_is_refused_unread() -> None:
    with pytest.raises(ValueError, match="more than"):
        decode_image(b"\x00" * 11, limit=10)
    # The bound a configuration sets: what its DRAM's blocks can take, never the 1 GiB cap.
    assert kept.image_bound(64 << 20) < 4 << 20
    assert kept.image_bound(1 << 50) == kept.MAX_IMAGE_BYTES


def test_verification_finds_each_changed_block_and_reports_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kept, "_VERIFY_CHUNK_BYTES", 8192)
    memory = bytearray(os.urandom(64 << 10))
    spans = [
        (o, 4096, xxhash.xxh3_64_intdigest(memory[o : o + 4096])) for o in range(0, 65536, 4096)
    ]
    memory[3 * 4096 + 17] ^= 1
    memory[15 * 4096 + 4095] ^= 0x80
    seen: list[tuple[int, int]] = []
    ok = verify_blocks(memoryview(memory), spans, lambda done, total: seen.append((done, total)))
    assert [i for i, fine in enumerate(ok) if not fine] == [3, 15]
    assert seen[-1] == (65536, 65536)
    assert len(seen) >= 8
