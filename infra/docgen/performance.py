"""The performance page's tables, rendered from the results committed under docs/results/.

The benchmarks write their JSON under `.bench/` (git-ignored, this machine's last run); `make bench-publish`
(`--publish`) copies each benchmark's file into docs/results/, which is committed with each release, so the
published site and a fresh clone show the same figures. docs/performance.md holds the prose and a marker per
benchmark, `<!-- bench:NAME -->`; at `make docs` the mkdocs hook (infra/docgen/hooks.py) replaces each marker
with the table of `docs/results/NAME.json` and a line saying whether its figures are measured or simulated
(stand-in nodes, a stand-in NVML), or, when the file is absent, which commands write and publish it. No
figure is copied by hand. The history of figures by build is in docs/CHANGELOG.md.

    python -m infra.docgen.performance [--results docs/results]   # print the rendered page
    python -m infra.docgen.performance --publish                  # copy .bench/*.json into docs/results/
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / ".bench"
"""Where the benchmarks write (git-ignored): the source of `--publish`, and of the pictures."""
RESULTS_DIR = REPO / "docs" / "results"
"""The committed results the page renders: `make bench-publish` copies them from `BENCH_DIR`."""
PAGE = REPO / "docs" / "performance.md"
MARKER = re.compile(r"<!-- bench:([a-z-]+) -->")

PICTURES = ("goodput-timeline.png", "recovery-paths.png", "recovery-timeline.png", "recovery-lost.png",
            "checkpoint.png")
"""What `make bench-plots` draws under `.bench/`; the hook publishes those present under `bench/` in the site."""


def _num(value: Any, pattern: str = "{:.2f}", suffix: str = "") -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return pattern.format(value) + suffix
    return str(value)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{value * 100:.1f} %"


def _cell(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = f"{value:,}"
    text = value if isinstance(value, str) else _num(value)
    return " ".join(text.split()).replace("|", "\\|")


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _machine(payload: Any) -> str:
    m = payload.get("machine") if isinstance(payload, dict) else None
    if not m:
        return ""
    load = m.get("loadavg_before") or [None]
    return (f"\n\nMeasured on {m.get('cpus', '?')} CPUs, Python {m.get('python', '?')}, load average "
            f"{_num(load[0], '{:.1f}')} at the start.")


def recovery(p: dict[str, Any]) -> str:
    floor = (p.get("floor") or {}).get("cold_start_s")

    def over_floor(value: Any) -> str:
        return _num(value / floor, "{:.2f}", "x") if isinstance(value, (int, float)) and floor else "-"

    rows = [[_fault(r.get("fault")), r.get("system"), _num(r.get("detection_s"), suffix=" s"),
             _num(r.get("restart_s"), suffix=" s"), over_floor(r.get("restart_s")),
             _num(r.get("time_to_recover_s"), suffix=" s"), _pct(r.get("goodput")),
             _num(r.get("wall_s"), "{:.1f}", " s"), r.get("completed"), r.get("recovery_path") or r.get("note")]
            for r in p.get("results", [])]
    out = table(["fault", "system", "detection", "relaunch (detection to first new step)", "relaunch / floor",
                 "time to recover (fault to first new step)", "goodput", "wall", "completed", "path / note"], rows)
    if floor:
        out += (f"\n\nThe floor, a cold start of the same two ranks from a local checkpoint with no orchestration: "
                f"{floor:.2f} s.")
    return out + _machine(p)


def paths(p: dict[str, Any]) -> str:
    rows = [[r.get("path"), f"{r.get('completed', '-')}/{r.get('runs', '-')}", _num(r.get("detection_s"), suffix=" s"),
             _num(r.get("teardown_s"), suffix=" s"), _num(r.get("restore_s"), suffix=" s"),
             _num(r.get("relaunch_s"), suffix=" s"), _num(r.get("time_to_recover_s"), suffix=" s"),
             _num(r.get("vs_floor"), suffix="x"), ", ".join(r.get("tiers") or [])]
            for r in p.get("summary", [])]
    out = table(["path", "runs", "detection", "teardown", "restore", "relaunch", "time to recover", "vs floor",
                 "tier / path taken"], rows)
    floor = (p.get("floor") or {}).get("cold_start_s")
    return out + (f"\n\nFloor (cold start, plain torchrun): {floor:.2f} s." if floor else "") + _machine(p)


def goodput(p: dict[str, Any]) -> str:
    rows = [[o.get("system"), _pct(o.get("goodput")), _num(o.get("wall_s"), "{:.0f}", " s"),
             o.get("steps_completed"), o.get("completed"), "; ".join(o.get("events") or [])]
            for o in p.get("outcomes", [])]
    return table(["system", "goodput", "wall", "steps", "finished", "what happened"], rows) + _machine(p)


def groups(p: dict[str, Any]) -> str:
    runs = p.get("runs") or [{}]
    rows = [[f.get("fault"), f.get("group"), _num(f.get("detection_s"), suffix=" s"),
             _num(f.get("back_s"), suffix=" s"), _num(f.get("healthy_step_s"), suffix=" s"),
             _num(f.get("healthy_gap_s"), suffix=" s"), _num(f.get("gap_ratio"), suffix="x"),
             _num(f.get("undetected_gap_s"), suffix=" s"), f.get("note") or ""] for f in runs[0].get("faults", [])]
    faults = table(["fault", "group", "detection", "group back (after detection)", "healthy groups' step",
                    "their longest gap, detection to back", "gap / step", "their longest gap before detection",
                    "note"], rows)
    runs_rows = [[r.get("system"), _pct(r.get("goodput")), _num(r.get("wall_s"), "{:.0f}", " s"), r.get("attempts"),
                  r.get("completed")] for r in runs]
    floor = (f"Cold-start floor (plain torchrun from a local checkpoint): {_num(p.get('floor_s'), suffix=' s')}. "
             "A healthy group's pause under way when the fault is detected is split at the detection: the part "
             "before it is the fault's (a straggler's pace, TorchFT's timeout), the part after it the recovery's.")
    return "\n\n".join([faults, floor, table(["run (same job, same five faults)", "goodput", "wall", "attempts",
                                                 "completed"], runs_rows)]) + _machine(p)


def checkpoint(p: dict[str, Any]) -> str:
    rows = []
    for f in p.get("figures", []):
        unit = f.get("unit", "")
        ratio = _num(f.get("ratio"), suffix=f"x the {f.get('ratio_of')}" if f.get("ratio_of") else "x")
        rows.append([f.get("name"), _num(f.get("trainguard"), "{:.3f}", f" {unit}"),
                     _num(f.get("baseline"), "{:.3f}", f" {unit}"), _num(f.get("floor"), "{:.3f}", f" {unit}"),
                     ratio, f"{f.get('target', '')} {'(met)' if f.get('met') else '(missed)' if f.get('met') is False else ''}".strip(),
                     f.get("note", "")])
    return table(["figure", "trainguard", "baseline", "floor", "ratio", "target", "note"], rows) + \
        _machine(p.get("context", {}))


def scale(p: dict[str, Any]) -> str:
    rows = [[lv.get("runs"), lv.get("completed"),
             f"{_num(lv.get('detection_s_p50'))} / {_num(lv.get('detection_s_p95'))} s",
             f"{_num(lv.get('recovery_s_p50'))} / {_num(lv.get('recovery_s_p95'))} s",
             f"{_num(lv.get('task_wait_ms_p50'), '{:.0f}')} / {_num(lv.get('task_wait_ms_p95'), '{:.0f}')} ms",
             _num(lv.get("controller_cpu_s"), "{:.1f}", " s"), _num(lv.get("controller_peak_rss_mib"), "{:.0f}", " MiB"),
             _num(lv.get("agent_peak_rss_mib_median"), "{:.0f}", " MiB"), _num(lv.get("events_per_run"), "{:.0f}")]
            for lv in p.get("levels", [])]
    return table(["runs", "completed", "hang detection p50 / p95", "detection to first new step p50 / p95",
                  "workflow-task wait p50 / p95", "controller CPU", "controller RSS", "agent RSS (median)",
                  "events per run"], rows) + _machine(p)


def nodes(p: list[dict[str, Any]]) -> str:
    rows = []
    for s in p:
        per_ckpt = (s.get("events_per_checkpoint") or {}).get("all")
        payload = s.get("largest_payload_bytes")
        rows.append([f"{s.get('nodes'):,}" if isinstance(s.get("nodes"), int) else s.get("nodes"), s.get("completed"),
                     f"{_num(s.get('events_total'), '{:,}')} / {_num(s.get('events_root'), '{:,}')}",
                     _num(per_ckpt, "{:.0f}"), s.get("max_pending"),
                     "-" if payload is None else f"{payload / 1024:.0f} KB", _num(s.get("relaunch_p95_s"), suffix=" s"),
                     f"{_num(s.get('controller_cpu_s'), '{:.1f}')} s / {_num(s.get('controller_peak_rss_mb'), '{:.0f}')} MB",
                     _num(s.get("wall_s"), "{:.0f}", " s")])
    return table(["nodes (x 8 ranks)", "completed", "events, all histories / the run's", "events per checkpoint",
                  "max pending", "largest payload", "relaunch p95", "controller CPU / peak RSS", "wall"], rows)


def pool(p: dict[str, Any]) -> str:
    rows = [[f"{_num(p.get('lease_s'))} / {_num(p.get('release_s'))} / {_num(p.get('lease_by_count_s'))} s",
             f"{p.get('trained', '-')} of {p.get('runs', '-')} within {_num(p.get('wall_s'), '{:.0f}')} s",
             f"{_num(p.get('training_p50_s'), '{:.1f}')} / {_num(p.get('training_p95_s'), '{:.1f}')} / "
             f"{_num(p.get('training_max_s'), '{:.1f}')} s",
             f"{_num(p.get('leased_p50_s'), '{:.1f}')} / {_num(p.get('leased_max_s'), '{:.1f}')} s",
             f"{p.get('pool_updates', '-')} / {p.get('pool_events', '-')}", _num(p.get("controller_cpu_s"), "{:.0f}", " s"),
             _num(p.get("load_avg_1m"), "{:.1f}")]]
    return table([f"one {p.get('lease_nodes', '?'):,}-node lease / release / by `num_nodes`" if isinstance(
        p.get("lease_nodes"), int) else "lease / release / by `num_nodes`", "runs training",
        "start to training p50 / p95 / max", "start to lease p50 / max", "pool updates / events", "controller CPU",
        "load"], rows)


def attribution(p: list[dict[str, Any]]) -> str:
    rows = [[r.get("mode"), f"{r.get('correct', '-')}/{r.get('trials', '-')}", _num(r.get("detection_p50_s"), suffix=" s"),
             _num(r.get("detection_p95_s"), suffix=" s"), _num(r.get("culprit_extra_p50_s"), suffix=" s"),
             _num(r.get("culprit_extra_s"), suffix=" s"), r.get("false_hangs")] for r in p]
    return table(["mode", "right", "detect p50", "detect p95", "culprit +s p50", "culprit +s p95",
                  "false hangs (fault-free runs)"], rows)


def soak(p: dict[str, Any]) -> str:
    c, config = p["counts"], p.get("config", {})
    kills = c.get("kills", {})
    signals = c.get("kills_by_signal", {})
    recovery = c.get("recovery_s") or {}
    by_component = ", ".join(
        f"{name} {n} ({signals.get(name, {}).get('SIGKILL', 0)} SIGKILL, "
        f"{signals.get(name, {}).get('SIGTERM', 0)} SIGTERM)" for name, n in kills.items())
    rows = [
        ["seed", c.get("seed")],
        ["minutes of chaos", c.get("chaos_minutes")],
        ["kills", f"{c.get('kills_total')} ({_num(c.get('kills_per_hour'), '{:.0f}')} an hour)"],
        ["kills by component", by_component],
        ["kills whose component did not come back", c.get("kill_errors")],
        ["runs recovered after a kill, median / p95 / max", f"{_num(recovery.get('median'), '{:.1f}', ' s')} / "
         f"{_num(recovery.get('p95'), '{:.1f}', ' s')} / {_num(recovery.get('max'), '{:.1f}', ' s')}"],
        ["kills that came before the runs had recovered from the previous one",
         recovery.get("kills_before_recovery", "-")],
        ["runs started / completed / failed / unfinished", f"{c.get('runs_started')} / {c.get('runs_completed')} / "
         f"{c.get('runs_failed')} / {c.get('runs_unfinished')}"],
        ["runs paused / resumed by the soak (operator) / nodes uncordoned by it",
         f"{c.get('runs_paused', '-')} / {c.get('resumes_after_pause')} / {c.get('uncordons')}"],
        ["duplicate rank sets / incidents counted twice", f"{c.get('duplicate_rank_sets')} / "
         f"{c.get('duplicate_incidents')}"],
        ["commits observed / checkpoints lost", f"{c.get('commits_observed')} / {c.get('checkpoints_lost')}"],
        ["final state digest mismatches", c.get("digest_mismatches")],
        ["incidents", ", ".join(f"{k} {v}" for k, v in (c.get("incidents") or {}).items()) or "none"],
        ["result", "pass" if p.get("ok") else "FAIL: " + "; ".join(p.get("failures", []))[:300]],
    ]
    return table(["soak", "figure"], rows) + (
        f"\n\nReproduce: `make soak SOAK_ARGS=\"--minutes {_num(config.get('minutes'), '{:g}')} "
        f"--seed {c.get('seed')} --pools {config.get('pools', 1)}\"` (the seed fixes what is killed, how and "
        f"when relative to recovery; the load of the machine sets how many kills fit in the time).")


MEASURED = "measured"
SIMULATED = "simulated"

STANDIN_NVML = "simulated: a stand-in NVML"
"""What a GPU fault's row says: `infra/bench/nvml_standin` raises the XID (no GPU here); the rest is real."""


def _fault(name: Any) -> Any:
    """A recovery row's fault, labelled when its figure is simulated (the GPU fault's stand-in NVML)."""
    return f"{name} ({STANDIN_NVML})" if name in ("gpu", "gpu-fault") else name


@dataclass(frozen=True, slots=True)
class Bench:
    file: str
    make: str
    render: Callable[[Any], str]
    kind: str = MEASURED
    """`measured` (real ranks, real Temporal and store on the machine named) or `simulated` (stand-ins)."""
    how: str = "real ranks, node agents, controller, Temporal dev server and SeaweedFS on one machine"
    """What ran, for the label under the table."""


_STANDIN_NODES = ("the real workflows on a Temporal dev server; the nodes are stand-ins (`infra/bench/standins.py`, "
                  "no ranks, no agents)")


BENCHES: dict[str, Bench] = {
    "recovery": Bench("recovery.json", "make bench-recovery", recovery,
                      how="real ranks, node agents, controller, Temporal dev server and SeaweedFS on one machine; "
                          f"a GPU fault's row is {STANDIN_NVML} (`infra/bench/nvml_standin`) raising the XID"),
    "paths": Bench("paths.json", "make bench-paths", paths),
    "goodput": Bench("goodput.json", "make bench-goodput", goodput),
    "groups": Bench("groups.json", "make bench-groups", groups,
                    how="real ranks under TorchFT, node agents, controller, Temporal dev server and SeaweedFS on one "
                        f"machine; the GPU fault is {STANDIN_NVML} (`infra/bench/nvml_standin`) raising the XID"),
    "checkpoint": Bench("checkpoint.json", "make bench-checkpoint", checkpoint),
    "scale": Bench("scale.json", "make bench-scale", scale,
                   how="real node agents, controller, Temporal dev server and SeaweedFS on one machine; each rank is "
                       "the lightweight stand-in `examples/standin.py` (no torch)"),
    "nodes": Bench("nodes.json", "make bench-nodes", nodes, SIMULATED, _STANDIN_NODES),
    "pool": Bench("pool.json", "make bench-pool", pool, SIMULATED, _STANDIN_NODES),
    "attribution": Bench("attribution.json", "make bench-attribution", attribution),
    "soak": Bench("soak-60.json", 'make soak SOAK_ARGS="--minutes 60 --json .bench/soak-60.json"', soak),
}
"""Marker name -> the JSON a benchmark writes under `.bench/` (and is published as under docs/results/), the
command that writes it, its table, and whether its figures are measured or simulated."""


def label(bench: Bench) -> str:
    """The line under a table that says whether its figures are measured or simulated, and what ran."""
    return f"**{bench.kind.capitalize()}**: {bench.how}."


def section(name: str, results_dir: Path = RESULTS_DIR) -> str:
    """The markdown for `<!-- bench:name -->`: the table of `docs/results/<file>` with its label, or what to run
    to make and publish it."""
    bench = BENCHES[name]
    path = results_dir / bench.file
    if not path.exists():
        return (f"!!! note \"Not published\"\n    `docs/results/{bench.file}` is absent: `{bench.make}` writes "
                f"`.bench/{bench.file}` (or `make bench` for every benchmark), `make bench-publish` copies it "
                f"here, then `make docs`.")
    try:
        body = bench.render(json.loads(path.read_text()))
    except (ValueError, TypeError, AttributeError, KeyError) as error:
        return (f"!!! warning \"Cannot read docs/results/{bench.file}\"\n    {type(error).__name__}: {error}. "
                f"Run `{bench.make}` and `make bench-publish` again, then `make docs`.")
    return f"{body}\n\n{label(bench)}\n\n<small>From `docs/results/{bench.file}` (`{bench.make}`).</small>"


def render_page(text: str, results_dir: Path = RESULTS_DIR) -> str:
    """`text` with every `<!-- bench:NAME -->` marker replaced by its section; unknown names raise."""
    def one(match: re.Match[str]) -> str:
        if match.group(1) not in BENCHES:
            raise KeyError(f"docs/performance.md: no benchmark named {match.group(1)!r} ({', '.join(BENCHES)})")
        return section(match.group(1), results_dir)

    return MARKER.sub(one, text)


def publish(bench_dir: Path = BENCH_DIR, results_dir: Path = RESULTS_DIR) -> list[str]:
    """Copy each benchmark's JSON from `bench_dir` into `results_dir` (a release commits them); returns the files
    copied. A file that does not parse is refused, so the site never publishes what it cannot render."""
    results_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for bench in BENCHES.values():
        source = bench_dir / bench.file
        if not source.exists():
            continue
        json.loads(source.read_text())  # ValueError: not published
        shutil.copyfile(source, results_dir / bench.file)
        copied.append(bench.file)
    return copied


def pictures(bench_dir: Path = BENCH_DIR) -> list[Path]:
    """The pictures `make bench-plots` left under `bench_dir`."""
    return [bench_dir / name for name in PICTURES if (bench_dir / name).exists()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.docgen.performance")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="render from these results")
    parser.add_argument("--publish", action="store_true",
                        help="copy the benchmarks' JSON from .bench/ into docs/results/ (commit them)")
    opts = parser.parse_args(argv)
    if opts.publish:
        copied = publish(BENCH_DIR, opts.results)
        print(f"published into {opts.results}: {', '.join(copied) or 'nothing (no .bench/*.json)'}")
        return 0
    print(render_page(PAGE.read_text(), opts.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
