"""``[pool]`` validation: insecure or impossible settings are refused, naming the field."""

from __future__ import annotations

import pytest

from kvtierd.config import load_config
from kvtierd.errors import ConfigError


def _pool(**values: object) -> dict[str, dict[str, object]]:
    return {"pool": dict(values)}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"url": "redis://pool:6379"}, "plaintext"),
        ({"url": "http://pool:6379"}, "redis://host:port or rediss://"),
        ({"url": "rediss://user:secret@pool:6379"}, "must not carry credentials"),
        ({"url": "redis://pool", "allow_plaintext": True, "ca_file": "/ca"}, "not rediss"),
        ({"url": "rediss://pool", "cert_file": "/c"}, "go together"),
        (
            {"url": "rediss://pool", "world_size": 2},
            "pool.group_id: is required when world_size > 1",
        ),
        ({"url": "rediss://pool", "world_size": 2, "rank": 2, "group_id": "g"}, "outside"),
        ({"url": "rediss://pool", "group_id": "a{b}"}, "group_id"),
        ({"url": "rediss://pool", "key_prefix": "has space"}, "key_prefix"),
    ],
)
def test_bad_pool_settings_are_refused(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=_pool(**values))


def test_the_secret_never_appears_in_the_error() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(overrides=_pool(url="rediss://user:hunter2@pool:6379"))
    assert "hunter2" not in str(caught.value)


def test_pool_under_trio_is_refused() -> None:
    with pytest.raises(ConfigError, match="asyncio"):
        load_config(overrides={"pool": {"url": "rediss://pool"}, "daemon": {"runtime": "trio"}})


def test_digest_covers_what_ranks_share_and_not_local_paths() -> None:
    base = {"url": "rediss://pool:6380", "group_id": "g", "world_size": 2}
    digest = load_config(overrides=_pool(**base)).pool.digest()
    same = load_config(
        overrides=_pool(**base, rank=1, ca_file="/other/ca.pem", username="rank1")
    ).pool.digest()
    assert same == digest
    # the same pool named by another host's name for it: still the same configuration
    assert (
        load_config(overrides=_pool(**{**base, "url": "rediss://10.0.0.7:6380"})).pool.digest()
        == digest
    )
    for change in ({"compress": True}, {"key_prefix": "x"}, {"cluster": True}):
        assert load_config(overrides=_pool(**{**base, **change})).pool.digest() != digest


def test_no_pool_by_default() -> None:
    assert load_config().pool.url == ""
