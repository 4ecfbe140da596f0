"""The recall tool on real SmolLM2 attention over a short real text (a few hundred tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtierd.testing.smollm2 import unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "loogle" / "shortdep_qa.jsonl"
REASON = unavailable_reason()

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
    pytest.mark.skipif(not DATA.exists(), reason=f"shared data missing: {DATA}"),
]


@pytest.mark.timeout(900)
def test_attention_recall_tool_on_real_text(capsys: pytest.CaptureFixture[str]) -> None:
    from tools import attention_recall

    argv = [
        "--data",
        str(DATA),
        "--tokens",
        "400",
        "--docs",
        "1",
        "--queries",
        "8",
        "--budget",
        "0.25",
        "--threads",
        "2",
        "--json",
    ]
    assert attention_recall.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    # The captured q and K reproduce the model's own attention output.
    assert result["capture_check_max_abs_err"] < 1e-3
    recall = result["recall"]
    assert set(recall) >= {"oracle", "slsap", "quest_full_scan", "mean_key", "recency"}
    for name, value in recall.items():
        assert 0 < value <= 1 + 1e-6, name
        if name != "oracle_per_head":
            assert value <= recall["oracle"] + 1e-6, name
    assert result["documents"][0]["tokens"] == 400
    assert 0 <= result["lead_time_prediction"] <= 1
