"""Shared pytest configuration: tests marked ``slow`` run only when asked for.

Run them with ``pytest -m slow`` (or set KCOMPACT_SLOW=1 to include them in a normal run).
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("KCOMPACT_SLOW") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with `pytest -m slow` or KCOMPACT_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
