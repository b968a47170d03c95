"""The checkpoint benchmark's samples, targets, figures and printed report (`infra.bench.checkpoint` measures).

The workload's shape (the step's matmul, the DDP job's nodes and ranks) lives here too: the figures describe it
and the measurements follow it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STEP_MATRIX = 1024
"""Side of the square matmul that stands in for a training step (about 25 ms on one core here)."""
STALL_TARGET = 1.2
"""Async stall at most this many times the in-memory copy floor."""
THROUGHPUT_TARGET = 0.9
"""trainguard's upload/download rate at least this fraction of raw boto3's."""
MB = 1e6
DDP_NODES = 2
DDP_RANKS_PER_NODE = 2


# ------------------------------------------------------------------------------------------- results


@dataclass(slots=True)
class Figure:
    """One row of the report: trainguard's median against a baseline and, where one exists, a floor."""

    name: str
    unit: str
    trainguard: float
    baseline: float | None = None
    floor: float | None = None
    ratio: float | None = None
    ratio_of: str = ""
    """What the ratio divides by: "floor" or "baseline"."""
    target: str = ""
    met: bool | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)
    note: str = ""


@dataclass(slots=True)
class StallSamples:
    floor_s: list[float] = field(default_factory=list)
    async_s: list[float] = field(default_factory=list)
    async_reported_s: list[float] = field(default_factory=list)
    """What `RankRun.save` itself returned (its own clock, inside the call)."""
    sync_s: list[float] = field(default_factory=list)
    write_s: list[float] = field(default_factory=list)
    """Background write (torch.save, fsync, sha256, meta file) from `save` returning to the meta file."""
    slowdown_s: list[float] = field(default_factory=list)
    """Extra time the training steps run during the background write took, over idle steps."""
    step_inflation: list[float] = field(default_factory=list)
    idle_step_s: list[float] = field(default_factory=list)
    shard: Path | None = None
    shard_meta: dict[str, Any] = field(default_factory=dict)
    dcp_s: list[float] = field(default_factory=list)
    """`RankRun.save` of the same state in DCP (`checkpoint_format="dcp"`, a one-rank gloo group)."""
    dcp_write_s: list[float] = field(default_factory=list)
    """DCP's background plan and write, hashing and meta file, after `save` returned."""


@dataclass(slots=True)
class TransferSamples:
    size_bytes: int = 0
    upload_tg_s: list[float] = field(default_factory=list)
    upload_raw_s: list[float] = field(default_factory=list)
    download_tg_s: list[float] = field(default_factory=list)
    download_raw_s: list[float] = field(default_factory=list)
    upload_digest: str = "sha256_file"
    """The function trainguard's upload checksums the local file with before it uploads."""
    upload_digest_s: list[float] = field(default_factory=list)
    sha256_s: list[float] = field(default_factory=list)
    """sha256_file of the shard: what trainguard's download verifies the downloaded file with."""


@dataclass(slots=True)
class ReplicatedSamples:
    """One 4-rank DDP checkpoint, per repeat, for each mode: `every` (every rank saves), `once` (replicated)."""

    stored_bytes: dict[str, list[int]] = field(default_factory=lambda: {"every": [], "once": []})
    """Bytes of the step's objects in the store once committed (shards; the manifest and records aside)."""
    objects: dict[str, list[int]] = field(default_factory=lambda: {"every": [], "once": []})
    commit_s: dict[str, list[float]] = field(default_factory=lambda: {"every": [], "once": []})
    """From the four `save` calls to the manifest written."""
    write_s: dict[str, list[float]] = field(default_factory=lambda: {"every": [], "once": []})
    """...of which until every rank's meta file was written (snapshot and background write)."""
    upload_s: dict[str, list[float]] = field(default_factory=lambda: {"every": [], "once": []})
    """...of which the two nodes' uploads (each node's shards, then its record); the rest is the committer's pass."""



# ------------------------------------------------------------------------------------------- figures


def _median(values: list[float]) -> float:
    return statistics.median(values)


def stall_figures(s: StallSamples, size_mib: int) -> list[Figure]:
    floor, stall, sync = _median(s.floor_s), _median(s.async_s), _median(s.sync_s)
    effective = [a + b for a, b in zip(s.async_s, s.slowdown_s, strict=True)]
    ratio = stall / floor
    return [
        Figure(f"checkpoint stall, {size_mib} MiB", "s", stall, sync, floor, ratio, "floor",
               f"<= {STALL_TARGET}x floor", ratio <= STALL_TARGET,
               {"trainguard": s.async_s, "trainguard_reported": s.async_reported_s, "baseline": s.sync_s,
                "floor": s.floor_s},
               "time RankRun.save blocks the caller"),
        Figure("stall vs synchronous save", "s", stall, sync, None, stall / sync, "baseline", "", None,
               {"trainguard": s.async_s, "baseline": s.sync_s}),
        Figure(f"DCP checkpoint stall, {size_mib} MiB", "s", _median(s.dcp_s), stall, floor,
               _median(s.dcp_s) / floor, "floor", f"<= {STALL_TARGET}x floor",
               _median(s.dcp_s) / floor <= STALL_TARGET, {"trainguard": s.dcp_s, "baseline": s.async_s,
                                                          "floor": s.floor_s},
               "RankRun.save in DCP (async_save: staged CPU copy, then plan and write in a thread); "
               "baseline: the torch.save format's stall"),
        Figure("DCP background write (overlapped)", "s", _median(s.dcp_write_s), _median(s.write_s), None, None,
               "", "", None, {"trainguard": s.dcp_write_s, "baseline": s.write_s},
               "DCP plan + write + fsync + sha256 of every file + meta file; baseline: torch.save format's"),
        Figure("background write (overlapped)", "s", _median(s.write_s), None, None, None, "", "", None,
               {"trainguard": s.write_s},
               "torch.save + fsync + sha256 + meta file, from save() returning, while training steps run"),
        Figure("training slowed during write", "s", _median(s.slowdown_s), None, None,
               _median(s.step_inflation), "idle step", "", None,
               {"trainguard": s.slowdown_s, "step_inflation": s.step_inflation, "idle_step_s": s.idle_step_s},
               f"extra time of {STEP_MATRIX}x{STEP_MATRIX} single-thread matmul steps run during the write, "
               f"over the same steps timed just before (median {_median(s.idle_step_s) * 1e3:.1f} ms); "
               "ratio: mean step during the write / idle step"),
        Figure("stall + slowdown vs sync save", "s", _median(effective), sync, None,
               _median(effective) / sync, "baseline", "", None,
               {"trainguard": effective, "baseline": s.sync_s},
               "what a checkpoint costs training in all, per repeat, against the blocking save"),
    ]


def transfer_figures(t: TransferSamples) -> list[Figure]:
    def rates(seconds: list[float]) -> list[float]:
        return [t.size_bytes / MB / value for value in seconds]

    checks = {"upload": (_median(t.sha256_s), "sha256 while reading, a manifest GET and a HEAD"),
              "download": (_median(t.sha256_s), "sha256 while writing")}
    figures = []
    for what, tg, raw in (("upload", t.upload_tg_s, t.upload_raw_s),
                          ("download", t.download_tg_s, t.download_raw_s)):
        tg_rate, raw_rate = _median(rates(tg)), _median(rates(raw))
        ratio = tg_rate / raw_rate
        check_s, check_note = checks[what]
        paired = [r / v for v, r in zip(tg, raw, strict=True)]
        figures.append(Figure(
            f"{what} {t.size_bytes / (1 << 20):.0f} MiB shard", "MB/s", tg_rate, raw_rate, None, ratio,
            "baseline", f">= {THROUGHPUT_TARGET}x raw", ratio >= THROUGHPUT_TARGET,
            {"trainguard_s": tg, "baseline_s": raw, "trainguard_mb_s": rates(tg), "baseline_mb_s": rates(raw),
             "trainguard_minus_checksum_mb_s_estimate": rates([max(1e-9, v - check_s) for v in tg]),
             # The store slows as it fills: a per-round ratio is immune to that drift between rounds.
             "paired_ratio": paired},
            f"trainguard's time includes its checks ({check_note}); per-round ratios "
            f"{' '.join(f'{r:.2f}' for r in paired)} (median {_median(paired):.2f})"))
    figures.append(Figure("  sha256 alone", "MB/s", _median(rates(t.sha256_s)), None, None, None,
                          "", "", None, {"seconds": t.sha256_s},
                          "a sha256 pass over the shard, file in the page cache: the checksum's own cost, which "
                          "upload and download now pay as the bytes stream through"))
    return figures


def replicated_figures(r: ReplicatedSamples, size_mib: int) -> list[Figure]:
    world = DDP_NODES * DDP_RANKS_PER_NODE
    stored = {mode: _median([float(b) for b in r.stored_bytes[mode]]) / MB for mode in ("every", "once")}
    commit = {mode: _median(r.commit_s[mode]) for mode in ("every", "once")}
    objects = {mode: _median([float(n) for n in r.objects[mode]]) for mode in ("every", "once")}
    parts = {mode: f"write {_median(r.write_s[mode]):.2f} s + upload {_median(r.upload_s[mode]):.2f} s + "
                   f"committer pass {commit[mode] - _median(r.write_s[mode]) - _median(r.upload_s[mode]):.2f} s"
             for mode in ("every", "once")}
    return [
        Figure(f"{world}-rank DDP bytes uploaded, {size_mib} MiB state", "MB", stored["once"], stored["every"], None,
               stored["once"] / stored["every"], "baseline", "", None,
               {"trainguard": [b / MB for b in r.stored_bytes["once"]],
                "baseline": [b / MB for b in r.stored_bytes["every"]],
                "objects_trainguard": [float(n) for n in r.objects["once"]],
                "objects_baseline": [float(n) for n in r.objects["every"]]},
               f"the step's objects in the store: tg.init(replicated=True) ({objects['once']:.0f} object) "
               f"against every rank saving ({objects['every']:.0f} objects), "
               f"{DDP_NODES} nodes x {DDP_RANKS_PER_NODE} ranks"),
        Figure(f"{world}-rank DDP commit time", "s", commit["once"], commit["every"], None,
               commit["once"] / commit["every"], "baseline", "", None,
               {"trainguard": r.commit_s["once"], "baseline": r.commit_s["every"],
                "write_trainguard": r.write_s["once"], "write_baseline": r.write_s["every"],
                "upload_trainguard": r.upload_s["once"], "upload_baseline": r.upload_s["every"]},
               f"from the {world} saves to the manifest: replicated {parts['once']}; "
               f"every rank {parts['every']}"),
    ]


# ------------------------------------------------------------------------------------------- report

LEGEND = (
    "trainguard: RankRun.save (async: in-memory snapshot, background write); _upload_one/_download_one",
    "baseline:   torch.save + flush + fsync of the same state to the same disk; boto3 upload_file/"
    "download_file, same TransferConfig, same store, alternating order; 4-rank DDP: every rank saves",
    "floor:      trainguard.rank._snapshot alone (the in-memory copy save() cannot avoid)",
)


def _cell(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value:.3f} s"
    if unit == "MB":
        return f"{value:.1f} MB"
    return f"{value:.0f} {unit}"


def report(figures: list[Figure], context: dict[str, Any]) -> None:
    """Print the table of figures to stdout (the only output of this module besides logging and JSON)."""
    header = ["figure", "trainguard", "baseline", "floor", "ratio", "target", "met?"]
    rows = [header]
    for f in figures:
        ratio = "-" if f.ratio is None else f"{f.ratio:.2f}x {f.ratio_of}"
        met = "-" if f.met is None else ("yes" if f.met else "NO")
        rows.append([f.name, _cell(f.trainguard, f.unit), _cell(f.baseline, f.unit), _cell(f.floor, f.unit),
                     ratio, f.target or "-", met])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        f"checkpoint benchmark: {context['size_mib']} MiB float32 state, "
        f"medians of {context['repeats']} repeats, {context['cpus']} CPUs "
        f"(load {context['load_avg_start']:.1f} at start, {context['load_avg_end']:.1f} at end), "
        f"torch {context['torch']} "
        f"({context['torch_threads']} thread), parts {context['part_size_mib']} MiB x "
        f"{context['transfer_concurrency']}",
        "",
    ]
    for index, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    lines.extend(["", *LEGEND])
    lines.extend(f"- {f.name}: {f.note}" for f in figures if f.note)
    print("\n".join(lines))


def write_json(path: Path, figures: list[Figure], context: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"context": context, "figures": [asdict(f) for f in figures]}
    path.write_text(json.dumps(payload, indent=1) + "\n")
