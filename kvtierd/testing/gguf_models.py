"""Real models that ship as GGUF files inside PyPI packages, loaded offline: what every model
module here (:mod:`.smollm2`, :mod:`.gemma3`) shares.

transformers' GGUF loader dequantises a GGUF file into ordinary float layers; it needs the
``gguf`` and ``accelerate`` packages. Nothing here downloads anything: ``HF_HUB_OFFLINE`` and
``TRANSFORMERS_OFFLINE`` are forced to 1 before transformers is imported. The model packages are
never imported (some need a plugin host we do not have): we only ask the import system where
they live (:func:`package_dir`).

Engines that load Hugging Face folders (vLLM) get one from :func:`export_hf_folder`:
transformers refuses to ``save_pretrained`` a GGUF-loaded model ("quantized with gguf and is not
serializable"), so the dequantised weights go into a plain model of the same architecture, built
from the same config without its ``quantization_config``. Every failure to find a piece of the
stack raises :class:`ModelUnavailableError`, an ``ImportError`` whose message names what is
missing and how to install it; tests turn a model module's ``unavailable_reason()`` into a skip
reason.
"""

from __future__ import annotations

import enum
import fcntl
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtierd.errors import KvtierError

__all__ = [
    "STACK_INSTALL_HINT",
    "ModelDType",
    "ModelUnavailableError",
    "export_hf_folder",
    "load_gguf",
    "missing_modules",
    "model_cache_dir",
    "package_dir",
]

STACK_INSTALL_HINT = (
    "pip install torch==2.13.0 && "
    'pip install transformers gguf tokenizers accelerate "torch==2.13.0"'
)
#: Modules the loader imports, with the PyPI name that provides each.
_REQUIRED_MODULES = {
    "torch": "torch==2.13.0",
    "transformers": "transformers",
    "gguf": "gguf",
    "accelerate": "accelerate",
    "tokenizers": "tokenizers",
}
#: What :func:`export_hf_folder` writes besides the weights, so a folder from another GGUF or an
#: older export is rebuilt rather than trusted.
_EXPORT_MARK = "kvtierd-export.json"
_EXPORT_VERSION = 1


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


def missing_modules() -> list[str]:
    """The PyPI names of the loader's libraries that are not installed."""
    return [pip for mod, pip in _REQUIRED_MODULES.items() if importlib.util.find_spec(mod) is None]


def package_dir(package: str, install: str) -> Path:
    """Where the installed (never imported) ``package`` lives.

    Raises:
        ModelUnavailableError: it is not installed; the message says ``install``.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelUnavailableError(f"package {package} is not installed (install: {install})")
    return Path(locations[0])


def model_cache_dir() -> Path:
    """Where converted models are kept: ``$KVTIERD_MODEL_CACHE``, else
    ``$XDG_CACHE_HOME/kvtierd/models`` (``~/.cache/kvtierd/models``)."""
    explicit = os.environ.get("KVTIERD_MODEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtierd" / "models"


def load_gguf(
    path: Path, dtype: ModelDType, *, attn_implementation: str = "sdpa"
) -> tuple[Any, Any]:
    """The tokenizer and the causal LM of the GGUF file ``path``, offline, in evaluation mode,
    weights dequantised to ``dtype``.

    Raises:
        ModelUnavailableError: a library of the stack is missing.
    """
    missing = missing_modules()
    if missing:
        raise ModelUnavailableError(
            f"model stack missing: {', '.join(missing)} (install: {STACK_INSTALL_HINT})"
        )
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_logging: Any = importlib.import_module("transformers.utils.logging")
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
    return tokenizer, model


def export_hf_folder(
    source: Path,
    dtype: ModelDType,
    *,
    architecture: str,
    cache_dir: Path | None = None,
    adjust_config: Callable[[Any], None] | None = None,
) -> Path:
    """The GGUF file ``source`` as a plain Hugging Face folder (``config.json``, safetensors
    weights and the tokenizer) of transformers class ``architecture``, under ``cache_dir``
    (default :func:`model_cache_dir`) as ``<stem>-hf-<dtype>``: converted once, then reused.

    ``adjust_config`` may change the config before the plain model is built from it. The folder
    is written beside its final place and renamed into it, so an interrupted conversion leaves
    nothing half-written; a folder whose mark names another GGUF file, size or export version is
    rebuilt. Conversions of one cache directory run one at a time (a lock file there).

    Raises:
        ModelUnavailableError: as :func:`load_gguf`.
    """
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
            _export(source, dtype, architecture, adjust_config, folder, mark)
    return folder


def _export_matches(folder: Path, mark: dict[str, object]) -> bool:
    try:
        return bool(json.loads((folder / _EXPORT_MARK).read_text()) == mark)
    except (OSError, ValueError):
        return False


def _export(
    source: Path,
    dtype: ModelDType,
    architecture: str,
    adjust_config: Callable[[Any], None] | None,
    folder: Path,
    mark: dict[str, object],
) -> None:
    tokenizer, loaded = load_gguf(source, dtype)
    transformers: Any = importlib.import_module("transformers")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if adjust_config is not None:
        adjust_config(config)
    plain = getattr(transformers, architecture)(config).to(dtype.torch_dtype())
    plain.load_state_dict(loaded.state_dict())
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _EXPORT_MARK).write_text(json.dumps(mark))
        staging.chmod(0o755)  # mkdtemp makes it private; engines may run as other users
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
