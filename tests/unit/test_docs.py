"""The docs site builds strictly (a broken link, a missing anchor or a page left out of the nav fails), the
generated references (spec, CLI, environment variables) are what the code says, and the performance page renders
from the committed `docs/results/*.json`, each table labelled measured or simulated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from infra.docgen import cli_reference, env_reference, performance, spec_reference

REPO = Path(__file__).resolve().parents[2]


def test_site_builds_strictly(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                            str(tmp_path / "site")], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120, check=False)

    assert built.returncode == 0, built.stdout + built.stderr
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "TrainguardClient" in api and "RankRun" in api and "RunSpec" in api  # from the docstrings
    assert "on purpose" not in api  # maintainers' notes are comments, not the docstrings users read
    for page in ("concepts", "operations/troubleshooting", "reference/cli", "reference/environment"):
        assert (tmp_path / "site" / page / "index.html").exists(), page


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


def test_performance_page_says_which_bench_writes_and_publishes_an_absent_file(tmp_path: Path) -> None:
    page = performance.render_page(performance.PAGE.read_text(), results_dir=tmp_path)

    assert "<!-- bench:" not in page
    for bench in performance.BENCHES.values():
        assert (f"`docs/results/{bench.file}` is absent: `{bench.make}` writes `.bench/{bench.file}`" in page)
    assert page.count("`make bench-publish` copies it here") == len(performance.BENCHES)


def test_the_published_results_are_committed_and_render() -> None:
    published = sorted(p.name for p in performance.RESULTS_DIR.glob("*.json"))
    page = performance.render_page(performance.PAGE.read_text())

    assert "recovery.json" in published  # a fresh clone's site shows figures, not "Not published"
    assert "Cannot read" not in page
    for name in published:
        assert name in {b.file for b in performance.BENCHES.values()}, f"docs/results/{name}: no benchmark's"
        assert f"From `docs/results/{name}`" in page


def test_publish_copies_the_bench_json_and_refuses_a_broken_file(tmp_path: Path) -> None:
    bench, results = tmp_path / "bench", tmp_path / "results"
    bench.mkdir()
    (bench / "goodput.json").write_text(json.dumps({"outcomes": []}))
    (bench / "recovery-oldbuild.json").write_text("{}")  # not a benchmark's file: left behind

    assert performance.publish(bench, results) == ["goodput.json"]
    assert sorted(p.name for p in results.iterdir()) == ["goodput.json"]

    (bench / "nodes.json").write_text("{cut short")
    try:
        performance.publish(bench, results)
    except ValueError:
        assert not (results / "nodes.json").exists()
    else:
        raise AssertionError("a broken .bench file was published")


def test_each_table_says_measured_or_simulated(tmp_path: Path) -> None:
    (tmp_path / "recovery.json").write_text(json.dumps({"results": [
        {"fault": "crash", "system": "trainguard"}, {"fault": "gpu", "system": "trainguard"}]}))
    (tmp_path / "nodes.json").write_text(json.dumps([{"nodes": 4096}]))
    (tmp_path / "pool.json").write_text(json.dumps({"lease_nodes": 4096}))

    recovery = performance.section("recovery", tmp_path)
    nodes = performance.section("nodes", tmp_path)

    assert "**Measured**: real ranks" in recovery
    assert "| crash | trainguard |" in recovery and "| gpu (simulated: a stand-in NVML) | trainguard |" in recovery
    assert "**Simulated**: " in nodes and "stand-ins" in nodes
    assert "**Simulated**: " in performance.section("pool", tmp_path)
    assert {b.kind for b in performance.BENCHES.values()} == {performance.MEASURED, performance.SIMULATED}


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
    assert "Cannot read docs/results/pool.json" in performance.section("pool", tmp_path)


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


def test_cli_reference_is_current() -> None:
    assert cli_reference.PAGE.read_text() == cli_reference.render(), \
        "docs/reference/cli.md is not what trainguard/cli.py's parser says: run `make docs`"


def test_every_command_and_flag_is_in_the_cli_reference_with_its_help() -> None:
    page = cli_reference.PAGE.read_text()
    commands = list(cli_reference.commands())

    assert ("run", "start") in [words for words, _, _ in commands] and len(commands) >= 15
    for words, text, parser in commands:
        assert f"## `trainguard {' '.join(words)}`" in page
        assert text, f"trainguard {' '.join(words)} has no help text"
        for action in cli_reference.arguments(parser):
            assert f"| `{cli_reference._name(action)}` |" in page, (words, action.dest)
            assert action.help, f"trainguard {' '.join(words)} {cli_reference._name(action)} has no help text"


def test_cli_reference_shows_defaults_choices_and_required_flags() -> None:
    page = cli_reference.PAGE.read_text()

    assert "trainguard run drain ID --node NODE [--reason REASON]" in page
    assert "| `--timeout-s` | `120.0` |" in page and "| `--node` | required |" in page
    assert "One of `stop`, `python`, `skip-collective`, `io`." in page


def test_environment_reference_is_current() -> None:
    assert env_reference.PAGE.read_text() == env_reference.render(), \
        "docs/reference/environment.md is not what trainguard/environment.py and protocol.py say: run `make docs`"


def test_every_variable_the_code_names_is_documented_and_nothing_documented_is_gone() -> None:
    found = env_reference.names_in_code()
    documented = env_reference.documented()

    assert "TRAINGUARD_TEMPORAL_ADDRESS" in found and "TRAINGUARD_PROGRESS_FILE" in found
    undocumented = {name: files for name, files in found.items() if name not in documented}
    assert undocumented == {}, "add these to trainguard/environment.py's VARIABLES, then `make docs`"
    assert documented - set(found) == set(), "documented in trainguard/environment.py but named nowhere in the code"


def test_the_scan_reads_strings_and_comments_not_identifiers(tmp_path: Path) -> None:
    (tmp_path / "trainguard").mkdir()
    (tmp_path / "trainguard" / "m.py").write_text(
        'TRAINGUARD_SAYS = "x"\nA = os.environ.get("TRAINGUARD_NEW_KNOB")  # also TRAINGUARD_OTHER\n'
        'P = ("TRAINGUARD_S3_",)  # a prefix, `TRAINGUARD_*` a pattern\n')
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "job.sbatch").write_text('echo "${TRAINGUARD_JOB_KNOB:-x}"\n')

    assert env_reference.names_in_code(tmp_path) == {
        "TRAINGUARD_NEW_KNOB": ["trainguard/m.py"], "TRAINGUARD_OTHER": ["trainguard/m.py"],
        "TRAINGUARD_JOB_KNOB": ["examples/job.sbatch"]}


def test_each_variable_has_a_known_section_a_default_and_a_meaning() -> None:
    from trainguard.environment import SECTIONS, VARIABLES

    names = [v.name for v in VARIABLES]
    assert len(names) == len(set(names))
    assert [v for v in VARIABLES if v.section not in SECTIONS or not v.default or not v.meaning] == []
    assert all(doc for _, doc in env_reference.protocol_variables())


def test_every_readme_figure_says_measured_or_simulated() -> None:
    readme = (REPO / "README.md").read_text()
    table = readme.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| what")]

    assert len(rows) >= 6
    assert [r for r in rows if not ("measured" in r.split("|")[-2] or "simulated" in r.split("|")[-2])] == []
    standins = [r for r in rows if "4,096 nodes" in r or "XID" in r or "100 runs" in r]
    assert len(standins) == 3 and all("simulated" in r.split("|")[-2] for r in standins)


def snippet_region(path: Path, name: str) -> str:
    """The lines between `# --8<-- [start:NAME]` and `# --8<-- [end:NAME]` in `path`, dedented: what
    `--8<-- "PATH:NAME"` includes in the docs (pymdownx.snippets, `dedent_subsections`)."""
    import textwrap

    lines = path.read_text().splitlines(keepends=True)
    marks = [index for index, line in enumerate(lines) if line.strip() in (f"# --8<-- [start:{name}]",
                                                                             f"# --8<-- [end:{name}]")]
    assert len(marks) == 2, f"{path} has no single region {name!r}: marker lines {marks}"
    return textwrap.dedent("".join(lines[marks[0] + 1:marks[1]]))


def test_the_readmes_rank_snippet_is_the_ddp_recipes_tested_region() -> None:
    """The README cannot include a file, so its snippet is checked against one: the `rank` region of the DDP
    recipe, which tests/integration/test_recipes.py crashes and resumes to plain torchrun's digest."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("**Your own script as a rank**", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    region = snippet_region(REPO / "examples" / "recipes" / "ddp.py", "rank")

    assert "run.restore()" in region and "run.step_done(step)" in region and '"sched"' in region
    assert block == region, "README's rank snippet differs from examples/recipes/ddp.py's region `rank`: copy it"
