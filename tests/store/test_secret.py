"""The key secret: made once, private, and the same for every process that makes it at once."""

from __future__ import annotations

import multiprocessing
import stat
from pathlib import Path
from typing import Any

import pytest

from kvtierd.errors import ConfigError
from kvtierd.store.secret import SECRET_BYTES, load_secret


def _load(path: str, start: Any, out: Any) -> None:
    start.wait()
    out.put(load_secret(Path(path)))


def test_made_once_then_read_back(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "key.secret"
    made = load_secret(path)
    assert len(made) == SECRET_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_secret(path) == made
    assert sorted(p.name for p in path.parent.iterdir()) == ["key.secret"]


def test_hosts_that_make_it_at_the_same_moment_agree(tmp_path: Path) -> None:
    # Ranks of one TP group share the file and start together: each must end with the one secret
    # that was linked first, and none may fail because another cleaned up its temporary file.
    path = tmp_path / "key.secret"
    context = multiprocessing.get_context("fork")
    for _ in range(5):
        path.unlink(missing_ok=True)
        start = context.Barrier(4)
        out = context.Queue()
        workers = [context.Process(target=_load, args=(str(path), start, out)) for _ in range(4)]
        for worker in workers:
            worker.start()
        secrets = [out.get(timeout=30) for _ in workers]
        for worker in workers:
            worker.join(timeout=30)
            assert worker.exitcode == 0
        assert len(set(secrets)) == 1
        assert secrets[0] == path.read_bytes()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["key.secret"]


def test_a_secret_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "key.secret"
    load_secret(path)
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="readable by others"):
        load_secret(path)
