"""One-token attention for grouped-query models on CPU: transformers' SDPA, with the query heads
packed onto their key/value heads instead of SDPA's ``enable_gqa``.

For a single query token transformers' ``sdpa`` attention asks PyTorch for ``enable_gqa=True``
whenever there is no mask. On CPU in bf16 that kernel walks each key/value head once per query
head of its group: for SmolLM2-135M (9 query heads on 3 KV heads) a one-token forward over an
8K cache spent ~4.5 ms per layer in attention, three quarters of the forward. Packing the group's
query heads as ``n_rep`` query rows of their KV head (transformers' own ``pack_gqa``, which it uses
on devices where ``enable_gqa`` cannot take a mask) reads each KV head once: ~0.8 ms per layer,
and the same bits: each query row is reduced over the same keys in the same order (checked by
``tests/engines/test_hf.py``). Every other call (prompts, masks, dropout, biases) is handed to
transformers' ``sdpa_attention_forward`` unchanged, so a prefill computes exactly what it did.

:func:`use_packed_decode_attention` switches a model whose attention is ``"sdpa"`` to it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

__all__ = [
    "PACKED_SDPA",
    "packed_decode_sdpa",
    "packed_one_token",
    "register_attention",
    "use_packed_decode_attention",
]

#: The name the attention is registered under (``model.config._attn_implementation``).
PACKED_SDPA = "kvtierd_sdpa"


def packed_decode_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention; a one-token query without mask on a grouped-query
    layer runs with its heads packed onto the KV heads (see the module docstring)."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    q_length = query.shape[2]
    if (
        q_length != 1
        or groups <= 1
        or attention_mask is not None
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions", False)
    ):
        out, weights = sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
        return out, weights
    return packed_one_token(query, key, value, scaling), None


def packed_one_token(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token's attention (``query`` ``[batch, heads, 1, head_dim]``, ``key``/``value``
    ``[batch, kv_heads, n, head_dim]``) with each KV head's query heads packed as rows of one
    SDPA call; ``mask`` broadcasts to ``[batch, kv_heads, rows, n]`` (True: attend). Returns
    ``[batch, 1, heads, head_dim]``, what transformers' attention functions return."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    packed = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, scale=scaling
    )
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous()


def register_attention(name: str, function: Any) -> None:
    """Register ``function`` as transformers attention ``name``, with ``sdpa``'s masks."""
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, function)
    if name not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_packed_decode_attention(model: Any) -> bool:
    """Switch ``model`` from ``"sdpa"`` attention to :func:`packed_decode_sdpa`; whether it
    uses it now (models on another attention implementation are left alone)."""
    current = getattr(model.config, "_attn_implementation", None)
    if current == PACKED_SDPA:
        return True
    if current != "sdpa":
        return False
    register_attention(PACKED_SDPA, packed_decode_sdpa)
    model.set_attn_implementation(PACKED_SDPA)
    return bool(model.config._attn_implementation == PACKED_SDPA)
