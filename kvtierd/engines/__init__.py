"""Adapters that put kvtierd under real inference engines."""
