"""The byte runs of a strided host tensor are its elements in row-major order: a block copied
into them, one after the other, lands where a torch copy into the view would put it."""

from __future__ import annotations

import pytest

from kvtierd.engines.host_runs import HostRuns, byte_runs

torch = pytest.importorskip("torch")


def _views() -> list[object]:
    g = torch.Generator().manual_seed(1)
    base = torch.randn((2, 12, 5, 2, 16), generator=g).to(torch.bfloat16)
    return [
        base,  # contiguous: one run
        base[:, 4:8],  # SGLang page_first: K and V
        base.permute(0, 2, 1, 3, 4)[:, :, 3:7],  # layer_first: one run per layer and half
        base[1, 3:9, :, 1],  # runs of one head
        base[:, :, 3:4],  # a dimension of one
        base[0, 0, 0, 0, :1],  # one element
        base[:, :0],  # nothing
    ]


@pytest.mark.parametrize("index", range(7))
def test_runs_are_the_row_major_bytes_and_write_through(index: int) -> None:
    view = _views()[index]
    runs = byte_runs(view)
    expected = view.contiguous().view(torch.uint8).numpy().tobytes()
    assert b"".join(bytes(r) for r in runs) == expected
    fill = torch.arange(view.numel(), dtype=torch.int16).view(torch.bfloat16).reshape(view.shape)
    data = fill.contiguous().view(torch.uint8).numpy().tobytes()
    done = 0
    for run in runs:
        run[:] = data[done : done + len(run)]
        done += len(run)
    assert torch.equal(view.view(torch.int16), fill.view(torch.int16))


def test_the_kept_storage_follows_the_tensor() -> None:
    runs = HostRuns()
    a, b = torch.zeros(64, dtype=torch.uint8), torch.ones(64, dtype=torch.uint8)
    assert bytes(runs(a[8:16])[0]) == bytes(8)
    assert bytes(runs(b[8:16])[0]) == b"\x01" * 8  # another storage: another view
    with pytest.raises(ValueError, match="host memory"):
        runs(torch.zeros(4, device="meta"))


def test_block_zero_spans_shifted_by_tiles_are_the_runs_of_any_block() -> None:
    # vLLM's CPU cache: [blocks, heads, 2 * tokens, head_dim], a block's planes K then V
    cache = torch.arange(6 * 3 * 2 * 8 * 4, dtype=torch.int16).view(6, 3, 16, 4)
    runs = HostRuns()

    def planes(block: int) -> torch.Tensor:
        return cache[block].view(3, 2, 8, 4).permute(1, 0, 2, 3)

    storage, spans = runs.spans(planes(0))
    tile = cache.stride(0) * cache.element_size()
    for block in range(6):
        shifted = [bytes(storage[a + block * tile : b + block * tile]) for a, b in spans]
        assert shifted == [bytes(r) for r in runs(planes(block))]
        assert b"".join(shifted) == planes(block).contiguous().numpy().tobytes()
