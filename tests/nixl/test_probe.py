"""The NIXL probe: its verdict on the NIXL installed, and on stand-ins that fail on purpose
(which need no NIXL: they shadow it on the child's ``PYTHONPATH``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvtierd
from kvtierd.nixl.probe import NixlOutcome, NixlVerdict, probe_nixl

pytestmark = pytest.mark.timeout(180)


def _stand_in(directory: Path, source: str) -> dict[str, str]:
    """A ``nixl`` package in ``directory`` whose import runs ``source``; the child's env."""
    package = directory / "nixl"
    package.mkdir()
    (package / "__init__.py").write_text(source)
    return {"PYTHONPATH": str(directory)}


def test_the_installed_nixl_passes_its_probe(nixl_verdict: NixlVerdict) -> None:
    assert nixl_verdict.ok, nixl_verdict
    assert nixl_verdict.outcome is NixlOutcome.OK
    assert nixl_verdict.exit_code == 0
    assert "UCX READ" in nixl_verdict.detail


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="NIXL is not installed")
def test_probe_without_a_usable_transport_says_so() -> None:
    verdict = probe_nixl(env={"UCX_TLS": "posix,sysv"})
    assert verdict.outcome is NixlOutcome.SELFTEST_FAILED, verdict
    assert "NIXL" in verdict.detail


def test_probe_of_a_broken_import_says_so(tmp_path: Path) -> None:
    env = _stand_in(tmp_path, "raise ImportError('libnixl.so: cannot open shared object')\n")
    verdict = probe_nixl(env=env)
    assert verdict.outcome is NixlOutcome.IMPORT_ERROR, verdict
    assert not verdict.ok
    assert "libnixl.so" in verdict.detail


def test_probe_of_a_crashing_child_names_the_signal(tmp_path: Path) -> None:
    env = _stand_in(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    verdict = probe_nixl(env=env)
    assert verdict.outcome is NixlOutcome.SIGNAL, verdict
    assert verdict.signal == "SIGSEGV"
    assert "memory" in verdict.detail


def test_probe_of_a_hanging_child_times_out(tmp_path: Path) -> None:
    verdict = probe_nixl(env=_stand_in(tmp_path, "import time\ntime.sleep(60)\n"), timeout_s=1.0)
    assert verdict.outcome is NixlOutcome.TIMEOUT, verdict
    assert not verdict.ok


def test_a_child_that_exits_without_a_verdict_is_not_ok(tmp_path: Path) -> None:
    verdict = probe_nixl(env=_stand_in(tmp_path, "import os\nos._exit(3)\n"))
    assert verdict.outcome is NixlOutcome.EXIT, verdict
    assert verdict.exit_code == 3


def test_importing_kvtierd_nixl_does_not_load_nixl() -> None:
    """The probe, the agent module and the descriptors import in any process: only making an
    agent loads NIXL."""
    code = (
        "import sys, kvtierd.nixl.agent, kvtierd.nixl.probe, kvtierd.nixl.descriptors; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('nixl', 'nixl_cu12')))"
    )
    root = str(Path(kvtierd.__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == "[]"
