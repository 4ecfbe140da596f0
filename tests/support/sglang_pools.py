"""SGLang 0.5.23's real ``MambaPoolHost`` (its page layout and its own page copy code), on CPU.

``sglang.srt.mem_cache.pool_host``'s package ``__init__`` imports the host pool group, which
imports SGLang's device memory pools, its model configurations and through them torchvision:
CUDA builds only, which cannot load beside this machine's CPU torch. ``mamba.py`` itself needs
none of that (its kernels are imported on CUDA and HIP only), so it is imported here as a
module of a package entry whose ``__init__`` is not run (where the package imports, it is
imported as it is). Nothing of SGLang's is replaced.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_PACKAGE = "sglang.srt.mem_cache.pool_host"


def mamba_pool_host_class() -> Any:
    """``sglang.srt.mem_cache.pool_host.mamba.MambaPoolHost``."""
    try:
        importlib.import_module(_PACKAGE)  # where torchvision loads, as SGLang imports it
    except ImportError:
        mem_cache = importlib.import_module("sglang.srt.mem_cache")
        package = types.ModuleType(_PACKAGE)
        package.__path__ = [f"{mem_cache.__path__[0]}/pool_host"]
        sys.modules[_PACKAGE] = package
    return importlib.import_module(f"{_PACKAGE}.mamba").MambaPoolHost


def mamba_pool_host(slots: int, layers: int = 3) -> Any:
    """A Mamba host pool of ``slots`` states (one page each: ``page_size`` 1) for a device pool
    of ``slots`` states of ``layers`` layers: a float32 temporal state and one conv state."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 4, 16, 8), conv=(torch.zeros(layers, slots, 32, 3),)
    )
    cls = mamba_pool_host_class()
    return cls(
        info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first"
    )
