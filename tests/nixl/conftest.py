"""The NIXL verdict, found once in a child process (:mod:`kvtierd.testing.fixtures`)."""

from __future__ import annotations

from kvtierd.testing.fixtures import NOT_INSTALLED, nixl_verdict, nixl_works

__all__ = ["NOT_INSTALLED", "nixl_verdict", "nixl_works"]
