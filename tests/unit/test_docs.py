"""The docs site builds strictly (a broken link, a missing anchor or a page left out of the nav fails), the spec
reference covers every field of the schema, and the performance page renders from `.bench/*.json`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from infra.docgen import performance, spec_reference

REPO = Path(__file__).resolve().parents[2]


def test_site_builds_strictly(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                            str(tmp_path / "site")], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120, check=False)

    assert built.returncode == 0, built.stdout + built.stderr
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "TrainguardClient" in api and "RankRun" in api and "RunSpec" in api  # from the docstrings


def test_spec_reference_is_current() -> None:
    assert spec_reference.PAGE.read_text() == spec_reference.render(), \
        "docs/reference/spec.md is not what trainguard/spec.py says: run `make docs`"


def test_every_schema_field_is_in_the_spec_reference() -> None:
    page = spec_reference.PAGE.read_text()
    paths = spec_reference.schema_paths()

    assert "checkpoint.stale_after_s" in paths and "entrypoint" in paths
    assert [p for p in paths if f"| `{p}` |" not in page] == []


def test_field_docstrings_are_read_from_the_source() -> None:
    from trainguard.spec import CheckpointSpec

    docs = spec_reference.field_docstrings(CheckpointSpec)

    assert set(docs) == set(CheckpointSpec.model_fields)
    assert docs["keep_last"].startswith("Committed checkpoints kept")


def test_performance_page_says_which_bench_writes_an_absent_file(tmp_path: Path) -> None:
    page = performance.render_page(performance.PAGE.read_text(), bench_dir=tmp_path)

    assert "<!-- bench:" not in page
    for bench in performance.BENCHES.values():
        assert f"`.bench/{bench.file}` is absent: `{bench.make}` writes it" in page


def test_performance_tables_come_from_the_json(tmp_path: Path) -> None:
    (tmp_path / "recovery.json").write_text(json.dumps({
        "results": [{"fault": "hang", "system": "trainguard", "detection_s": 2.06, "restart_s": 4.2,
                     "time_to_recover_s": 5.87,
                     "goodput": 0.795, "wall_s": 54.1, "completed": True, "recovery_path": "relaunch"}],
        "floor": {"cold_start_s": 5.25}, "machine": {"cpus": 2, "python": "3.11", "loadavg_before": [1.2, 1, 1]}}))
    (tmp_path / "nodes.json").write_text(json.dumps([
        {"nodes": 4096, "completed": True, "events_total": 31496, "events_root": 2404,
         "events_per_checkpoint": {"all": 9}, "max_pending": 260, "largest_payload_bytes": 50176,
         "relaunch_p95_s": 5.3, "controller_cpu_s": 19.3, "controller_peak_rss_mb": 227, "wall_s": 197}]))
    (tmp_path / "pool.json").write_text("not json")

    recovery = performance.section("recovery", tmp_path)
    nodes = performance.section("nodes", tmp_path)

    assert "| hang | trainguard | 2.06 s | 4.20 s | 0.80x | 5.87 s | 79.5 % | 54.1 s | yes | relaunch |" in recovery
    assert "5.25 s" in recovery and "load average 1.2" in recovery
    assert "| 4,096 | yes | 31,496 / 2,404 | 9 | 260 | 49 KB | 5.30 s | 19.3 s / 227 MB | 197 s |" in nodes
    assert "Cannot read .bench/pool.json" in performance.section("pool", tmp_path)


def test_an_unknown_marker_fails_the_build(tmp_path: Path) -> None:
    try:
        performance.render_page("<!-- bench:nonesuch -->", tmp_path)
    except KeyError as error:
        assert "nonesuch" in str(error)
    else:
        raise AssertionError("an unknown benchmark marker rendered")


def test_readme_is_short_and_its_links_exist() -> None:
    import re

    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\((docs/[^)#]+)", readme)

    assert len(readme.splitlines()) <= 300
    assert targets and [t for t in targets if not (REPO / t).exists()] == []


def test_the_soak_section_quotes_the_soak_report_and_its_seed(tmp_path: Path) -> None:
    (tmp_path / "soak-60.json").write_text(json.dumps({
        "ok": True, "failures": [], "config": {"minutes": 60, "pools": 1},
        "counts": {"seed": 2806, "chaos_minutes": 60, "kills_total": 231, "kills_per_hour": 231.0,
                   "kills": {"controller": 58, "agent": 58, "temporal": 58, "seaweedfs": 57},
                   "kills_by_signal": {"controller": {"SIGKILL": 30, "SIGTERM": 28}},
                   "recovery_s": {"median": 4.1, "p95": 20.2, "max": 31.0, "kills_before_recovery": 3},
                   "runs_started": 90, "runs_completed": 90, "runs_failed": 0, "runs_unfinished": 0,
                   "runs_paused": 0, "resumes_after_pause": 0, "uncordons": 0, "duplicate_rank_sets": 0,
                   "duplicate_incidents": 0, "commits_observed": 400, "checkpoints_lost": 0,
                   "digest_mismatches": 0, "incidents": {"agent_restart": 12}}}))

    soak = performance.section("soak", tmp_path)

    assert "| seed | 2,806 |" in soak and "--minutes 60 --seed 2806" in soak
    assert "| kills | 231 (231 an hour) |" in soak
    assert "| kills that came before the runs had recovered from the previous one | 3 |" in soak
    assert "controller 58 (30 SIGKILL, 28 SIGTERM)" in soak and "seaweedfs 57 (0 SIGKILL, 0 SIGTERM)" in soak
    assert "| runs started / completed / failed / unfinished | 90 / 90 / 0 / 0 |" in soak
    assert "| result | pass |" in soak
