"""Shared pytest configuration.

Every test runs by default, the ``slow`` ones included (the 10M-record exact-rounds compaction
and the five-SIGKILL mirror are acceptance tests of their issues; together about a minute).
Deselect them for a quick local loop with ``pytest -m "not slow"``.
"""
