"""The goodput report read from real histories: the no-fault baseline and a crashed-and-recovered run."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from trainguard.client import TrainguardClient
from trainguard.models import RunResult
from trainguard.report import build_report, main_report, render_table

from .conftest import RUN_TIMEOUT_S, checkpointed, make_spec, wait_until


def _wall_close(report_wall: float, result_wall: float) -> bool:
    """The history's start/close events and the workflow clock differ by a workflow task or two."""
    return abs(report_wall - result_wall) <= max(1.0, 0.05 * result_wall)


async def test_report_of_the_baseline(client: TrainguardClient, baseline: RunResult) -> None:
    report = await build_report(client.client, baseline.workflow_id)
    assert report.status == "COMPLETED" and report.runs == 1 and report.attempts == 1
    assert _wall_close(report.wall_s, baseline.wall_s), (report.wall_s, baseline.wall_s)
    assert sum(report.phases.values()) <= report.wall_s + 1e-6
    assert sum(report.phases.values()) == pytest.approx(report.wall_s, abs=1e-3), "phases tile the wall time"
    assert report.phases["running"] > 0 and report.phases["launching"] > 0
    assert report.phases["recovering"] == 0 and report.phases["paused"] == 0
    assert len(report.incidents) == len(baseline.incidents) == 0
    assert report.lost_s == 0
    assert report.steps_completed == baseline.steps_completed
    assert report.goodput == pytest.approx(baseline.goodput, abs=0.05)
    text = render_table(report)
    assert baseline.workflow_id in text and "running" in text


# `make test-slow`: the baseline's report above keeps the report's reading of a run in `make test`, and the
# unit tests of infra/report keep its incident rows.
@pytest.mark.slow
async def test_report_of_a_crash_and_its_recovery(client: TrainguardClient, baseline: RunResult, prefix: str,
                                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_id = await client.start_run(make_spec(prefix), workflow_id=f"it-report-{uuid.uuid4().hex[:8]}")
    await wait_until(client, run_id, checkpointed)

    live = await build_report(client.client, run_id)  # still running: the status query supplies the rest
    assert live.status == "RUNNING" and live.incidents == []
    assert live.phases["running"] > 0
    assert sum(live.phases.values()) == pytest.approx(live.wall_s, abs=1e-3)

    await client.inject_fault(run_id, "crash", node="node-1")
    result = await asyncio.wait_for(client.result(run_id), RUN_TIMEOUT_S)
    report = await build_report(client.client, run_id)

    assert _wall_close(report.wall_s, result.wall_s), (report.wall_s, result.wall_s)
    assert sum(report.phases.values()) <= report.wall_s + 1e-6
    assert report.phases["recovering"] > 0
    assert report.attempts == result.attempts == 2
    assert len(report.incidents) == len(result.incidents) == 1, "no incident lost"
    [loss] = report.incidents
    [incident] = result.incidents
    assert loss.kind == "crash" and loss.node == "node-1"
    assert loss.detection_s == incident.detection_s and loss.recovery_s == incident.recovery_s
    assert loss.resumed_step == incident.resumed_step
    assert loss.step_at_detection is not None and loss.step_at_detection >= incident.resumed_step
    assert loss.lost_s >= (incident.detection_s or 0) + (incident.recovery_s or 0)
    assert loss.lost_s < report.wall_s
    # The recovery runs from the detection to the next attempt's first step: it is the recovering phase
    # plus the second attempt's restore and launch.
    second = sum(s.seconds for s in report.segments
                 if s.attempt == 2 and s.phase in ("restoring", "launching"))
    assert second + report.phases["recovering"] == pytest.approx(incident.recovery_s, abs=0.5)

    png = tmp_path / "report.png"
    pytest.importorskip("matplotlib")
    assert await main_report(run_id, str(png)) == 0
    out = capsys.readouterr().out
    assert run_id in out and "lost to incidents" in out and f"wrote {png}" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
