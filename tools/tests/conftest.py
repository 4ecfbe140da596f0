"""The tools' own tests: each tool on its smallest settings, against the real components it
measures (fixtures from :mod:`kvtierd.testing`, as the package's tests use them)."""

from __future__ import annotations

from kvtierd.testing.fixtures import nixl_verdict, nixl_works

__all__ = ["nixl_verdict", "nixl_works"]
