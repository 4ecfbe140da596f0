"""The shapes of the largest legal requests that the loop-time checks pipeline: the most keys a
request may carry (:data:`N`), tiny blocks of a sparse-attention layout, and the queries of a
sparse READ as large as the protocol takes. ``tools/bench_loop.py`` measures another client's
LOOKUP latency beside them; ``tests/integration/test_loop_time.py`` checks that every one of them
is served correctly while the loop stays responsive."""

from __future__ import annotations

from kvtierd.protocol import MAX_KEYS_PER_REQUEST

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_TOKENS",
    "HEAD_DIM",
    "KV_HEADS",
    "LAYERS",
    "LAYOUT",
    "QUERY_HEADS",
    "SPARSE_BYTES",
    "N",
]

N = MAX_KEYS_PER_REQUEST
BLOCK_BYTES = 4096
LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 2, 1, 8, 4
LAYOUT = {
    "model_id": "loop",
    "layers": LAYERS,
    "kv_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "dtype": "float32",
    "block_tokens": BLOCK_TOKENS,
}
SPARSE_BYTES = 2 * LAYERS * KV_HEADS * HEAD_DIM * BLOCK_TOKENS * 4
QUERY_HEADS = (768 << 10) // (4 * LAYERS * HEAD_DIM)
