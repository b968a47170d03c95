"""Shared test setup: integration tests are marked by folder, and what the tests write stays in the repo's
ignored `.pytest-tmp/`: pytest's `tmp_path` folders (not /tmp/pytest-of-<user>) and torch's compile cache
(not /tmp/torchinductor_<user>), for the suite and the rank processes it starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SCRATCH = Path(__file__).resolve().parents[1] / ".pytest-tmp"


def pytest_configure(config: pytest.Config) -> None:
    if not config.option.basetemp:
        SCRATCH.mkdir(exist_ok=True)
        config.option.basetemp = str(SCRATCH / "pytest")
    cache = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(SCRATCH / "torchinductor")))
    cache.mkdir(parents=True, exist_ok=True)
    if cache.stat().st_uid == os.geteuid():
        # Ranks run as a user of their own (CI's trainguard-rank) and compile into it too: shared like /tmp.
        cache.chmod(0o1777)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/integration/" in str(item.path):
            item.add_marker(pytest.mark.integration)
