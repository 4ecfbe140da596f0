"""``tools/bench_sglang.py`` on a few pages, against SGLang's real HiCache storage layer."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage",
    reason="SGLang's storage layer is not installed (tools/setup.sh test installs it)",
)
pytestmark = pytest.mark.timeout(120)

from tools import bench_sglang  # noqa: E402


def test_benchmark_runs_and_checks_its_pages(tmp_path: Path) -> None:
    """``tools/bench_sglang.py`` on a few pages: every side measured, pages compared."""
    result = bench_sglang.measure(pages=4, batch=2, rounds=1, root=tmp_path)
    assert set(result["sides"]) == set(bench_sglang.LABELS)
    assert result["sides"]["kvtierd_v1"]["warm"]["gb_per_s"] > 0
    assert set(result["ratios"]["kvtierd_v1_vs_file_to_pool"]) == {"cold", "warm"}
