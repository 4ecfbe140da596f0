"""A configuration written back as TOML, its digest, and what differs between two
(``kvtierd.config_render``, pure)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtierd.config import Config, load_config
from kvtierd.config_render import config_digest, differences, load_rendered, render_config

SOME = """
[daemon]
log_level = "debug"
max_frame_bytes = 5000

[dram]
size = "1.5G"

[[tenants]]
name = "alpha"
uids = [1000]
dram_share = 0.5
"""


def _load(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "kvtierd.toml"
    path.write_text(text)
    return load_config(path)


def test_a_rendered_configuration_loads_back_to_itself(tmp_path: Path) -> None:
    for config in (Config(), _load(tmp_path, SOME)):
        text = render_config(config)
        assert load_rendered(text) == config
        assert _load(tmp_path, text) == config  # as a file, too
    text = render_config(_load(tmp_path, SOME))
    assert 'size = "1.5G"' in text  # sizes as the file writes them
    assert 'max_frame_bytes = "5000"' in text  # not rounded


@settings(max_examples=50, deadline=None)
@given(
    size=st.integers(16, 4096).map(lambda mib: mib << 20), level=st.sampled_from(["info", "debug"])
)
def test_the_digest_is_equal_exactly_when_the_configurations_are(size: int, level: str) -> None:
    a = load_config(None, {"dram": {"size": size}, "daemon": {"log_level": level}})
    b = load_config(None, {"dram": {"size": size}, "daemon": {"log_level": level}})
    assert config_digest(a) == config_digest(b)
    c = load_config(None, {"dram": {"size": size + (2 << 20)}, "daemon": {"log_level": level}})
    assert config_digest(a) != config_digest(c)


def test_differences_name_each_field_with_both_values(tmp_path: Path) -> None:
    found = differences(Config(), _load(tmp_path, SOME))
    assert [(d.name, d.before, d.after) for d in found] == [
        ("daemon.log_level", '"info"', '"debug"'),
        ("daemon.max_frame_bytes", '"1M"', '"5000"'),
        ("dram.size", '"1G"', '"1.5G"'),
        ("tenants", "[]", found[-1].after),
    ]
    assert 'name = "alpha"' in found[-1].after
    assert differences(Config(), Config()) == []
