"""The blocking client's API is what the async one generates (``python -m tools.unasync_client``).

A hand edit of ``kvtierd/client/_sync/client.py``, or an edit of the async source not followed by
the tool, fails here (and in ``tools/test.sh``'s check) with the diff.
"""

from __future__ import annotations

from tools import unasync_client


def test_the_generated_blocking_client_is_current() -> None:
    assert unasync_client.TARGET.read_text() == unasync_client.generate(), (
        "run `python -m tools.unasync_client`"
    )


def test_the_check_fails_on_a_stale_file(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    stale = tmp_path / "client.py"
    stale.write_text(unasync_client.TARGET.read_text().replace("def put(", "def put_by_hand(", 1))
    monkeypatch.setattr(unasync_client, "TARGET", stale)
    assert unasync_client.main(["--check"]) == 1
    assert "def put_by_hand(" in stale.read_text(), "--check must write nothing"


def test_async_only_names_in_code_are_found_but_not_in_strings() -> None:
    text = 'import anyio\n\n\ndef f():\n    """await the anyio way"""\n    return x  # async\n'
    assert unasync_client._async_left(text) == ["anyio"]
    assert unasync_client._async_left(unasync_client.TARGET.read_text()) == []
