"""Layer-wise delivery of leased blocks into an engine's K/V planes (``kvtierd.client.cuda``),
from a real daemon's arena: on CPU tensors everywhere, on a GPU where there is one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the CUDA delivery path needs torch (extra: model)")

from kvtierd.client import InvalidRequestError, connect  # noqa: E402
from kvtierd.client.cuda import (  # noqa: E402
    KvGeometry,
    PinnedRegion,
    block_tensors,
    deliver,
    delivered,
)
from kvtierd.protocol.messages import Layout  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402

LAYOUT = Layout("test/tiny", layers=4, kv_heads=2, head_dim=16, dtype="bfloat16", block_tokens=8)
GEOMETRY = KvGeometry.of(LAYOUT)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def _source(tokens: int, seed: int = 0) -> torch.Tensor:
    """An engine's planes ``[2L, H, T, D]`` of random K/V."""
    g = torch.Generator().manual_seed(seed)
    shape = (2 * GEOMETRY.layers, GEOMETRY.kv_heads, tokens, GEOMETRY.head_dim)
    return torch.randn(shape, generator=g).to(GEOMETRY.dtype)


def _blocks_of(planes: torch.Tensor) -> list[torch.Tensor]:
    """The layer-major blocks of ``planes``' tokens, as the engine adapters store them."""
    bt = GEOMETRY.block_tokens
    n = planes.shape[2] // bt
    return [planes[:, :, b * bt : (b + 1) * bt].contiguous() for b in range(n)]


def _store(ns, planes: torch.Tensor) -> list[bytes]:  # type: ignore[no-untyped-def]
    blocks = _blocks_of(planes)
    keys = [f"block-{i}".encode().ljust(16, b".") for i in range(len(blocks))]
    ns.put(keys, [b.view(torch.uint8).numpy() for b in blocks])
    return keys


def _delivered_to(device: str, daemon: DaemonProcess, start: int) -> None:
    source = _source(5 * GEOMETRY.block_tokens)
    with connect(daemon.socket) as client:
        ns = client.namespace("t", layout=LAYOUT)
        keys = _store(ns, source)
        client.evict()  # the blocks come back from NVMe, scattered over the arena
        ns.lookup(keys)
        capacity = start + source.shape[2] + 3
        planes = torch.zeros((*source.shape[:2], capacity, source.shape[3]), dtype=source.dtype)
        planes = planes.to(device)
        lease = ns.acquire(keys)
        with delivered(lease, GEOMETRY, planes, start) as delivery:
            assert client.stats()["leases"] == 1  # held until the copies are done
            for layer in range(GEOMETRY.layers):
                delivery.wait(layer)
        assert client.stats()["leases"] == 0
        assert delivery.layers == GEOMETRY.layers
        got = planes.cpu()
        span = slice(start, start + source.shape[2])
        assert torch.equal(got[:, :, span].view(torch.int16), source.view(torch.int16))
        assert not got[:, :, :start].any()
        assert not got[:, :, span.stop :].any()


@pytest.mark.parametrize("start", [0, 5])
def test_blocks_land_in_their_token_range_layer_by_layer(daemon: DaemonProcess, start: int) -> None:
    _delivered_to("cpu", daemon, start)


def test_on_cpu_every_layer_is_ready_at_once(daemon: DaemonProcess) -> None:
    source = _source(2 * GEOMETRY.block_tokens, seed=1)
    planes = torch.zeros_like(source)
    with deliver(_blocks_of(source), planes, 0) as delivery:
        assert delivery.events == [None] * GEOMETRY.layers
        assert all(delivery.ready(layer) for layer in range(GEOMETRY.layers))
    assert torch.equal(planes.view(torch.int16), source.view(torch.int16))


def test_bad_shapes_and_ranges_are_refused_before_any_copy(daemon: DaemonProcess) -> None:
    source = _source(2 * GEOMETRY.block_tokens, seed=2)
    blocks = _blocks_of(source)
    planes = torch.zeros_like(source)
    with pytest.raises(InvalidRequestError, match="do not fit"):
        deliver(blocks, planes, 1)  # one token past the end
    with pytest.raises(InvalidRequestError, match="does not fit planes"):
        deliver([b.float() for b in blocks], planes, 0)
    with pytest.raises(InvalidRequestError, match="does not fit planes"):
        deliver([b[:2] for b in blocks], planes, 0)
    with pytest.raises(InvalidRequestError, match="not \\[2L, H, T, D\\]"):
        deliver(blocks, planes[0], 0)
    with pytest.raises(InvalidRequestError, match="contiguous host memory"):
        deliver([b.transpose(2, 3).contiguous().transpose(2, 3) for b in blocks], planes, 0)
    assert not planes.any()
    delivery = deliver(blocks, planes, 0)
    with pytest.raises(InvalidRequestError, match=r"layer 4 is not in 0\.\.3"):
        delivery.wait(GEOMETRY.layers)
    with pytest.raises(InvalidRequestError, match="layer -1"):
        delivery.ready(-1)


def test_a_lease_of_another_block_size_is_refused(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("other", block_bytes=8192)
        ns.put([b"k" * 16], [bytes(8192)])
        with ns.lease([b"k" * 16]) as lease, pytest.raises(InvalidRequestError, match="8192"):
            block_tensors(lease, GEOMETRY)


def test_geometry_follows_the_layout() -> None:
    assert GEOMETRY.block_shape == (8, 2, 8, 16)
    assert GEOMETRY.block_bytes == 8 * 2 * 8 * 16 * 2
    with pytest.raises(InvalidRequestError, match="no torch dtype"):
        KvGeometry.of(Layout("m", layers=1, kv_heads=1, head_dim=1, dtype="int3", block_tokens=1))


def test_pinning_a_cpu_destination_is_nothing_to_do() -> None:
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    with PinnedRegion(buffer, "cpu") as region:
        assert not region.registered
    with pytest.raises(InvalidRequestError, match="contiguous host buffer"):
        PinnedRegion(buffer[::2], "cpu")


@CUDA
@pytest.mark.parametrize("start", [0, 5])
def test_on_a_gpu_blocks_land_in_hbm(daemon: DaemonProcess, start: int) -> None:
    _delivered_to("cuda", daemon, start)


@CUDA
def test_on_a_gpu_the_arena_is_pinned_while_registered(daemon: DaemonProcess) -> None:
    with connect(daemon.socket) as client:
        ns = client.namespace("t", layout=LAYOUT)
        arena = torch.frombuffer(ns.arena.writable(0, 1 << 20), dtype=torch.uint8)
        with PinnedRegion(arena, "cuda") as region:
            assert region.registered
            assert arena.is_pinned()
        assert not arena.is_pinned()


# -- the transformers adapter on the same path ------------------------------------------------


def _tiny_llama(device: str) -> object:
    """A two-layer Llama with random weights (transformers only: no download, no files)."""
    transformers = pytest.importorskip("transformers", reason="the HF adapter needs transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).to(device).eval()
    return model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_the_hf_adapter_restores_into_the_models_device(daemon: DaemonProcess, device: str) -> None:
    """A prompt stored, evicted and restored: the restored K/V equal the computed ones bit for
    bit in the model's own memory (on a GPU the restore goes through :func:`deliver` from the
    pinned arena; a prompt of 5 blocks less one token also takes the partial-block copy)."""
    from kvtierd.engines.hf import HfKvAdapter

    model = _tiny_llama(device)
    prompt = [int(t) for t in torch.randint(0, 128, (5 * 8,), generator=torch.Generator())]
    with connect(daemon.socket) as client:
        adapter = HfKvAdapter.open(client, model, model_id="test/tiny-llama", block_tokens=8)
        computed = adapter.prefill(prompt)
        assert computed.stored_blocks == 5
        client.evict()
        restored = adapter.prefill(prompt, store=False)
        assert (restored.cached_tokens, restored.hit_blocks) == (39, 5)
        for mine, theirs in zip(restored.cache.layers, computed.cache.layers, strict=True):
            assert mine.keys.device.type == device
            for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
                assert torch.equal(a[:, :, :39].view(torch.int16), b[:, :, :39].view(torch.int16))
        assert torch.allclose(restored.logits.float(), computed.logits.float(), atol=0.05)
        assert client.stats()["leases"] == 0
