"""Tests of the shared pool tier (issue 6) and of the harness they run on."""
