"""The soak's verdict: after the chaos, check every run's invariants (no incident counted twice, no
checkpoint lost, the baseline's final state) and write the report. `infra.chaos_soak.Soak` runs it."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from infra.soak_model import BUCKET, COMPONENTS, KEEP_LAST, RunRecord, SoakConfig, SoakReport, manifest_key

if TYPE_CHECKING:
    from infra.soak_chaos import Chaos
    from infra.soak_sampler import RankSampler


LOST_NODE_LOOKBACK_S = 60.0
"""How far before a node was taken as lost its report lists the kills (a watch's heartbeat timeout, its
node's check and a restart of the component all fit in it)."""


class SoakVerdict:
    """The checks and the report of a `Soak`, from what it recorded."""

    config: SoakConfig
    seed: int
    nodes: tuple[str, ...]
    runs: dict[str, RunRecord]
    baselines: dict[str, RunRecord]
    errors: list[str]
    uncordons: int
    leftovers: list[str]
    t0_wall: float
    """Unix time of the soak clock's zero (incidents carry Unix times)."""
    stack: Any
    chaos: Chaos | None
    sampler: RankSampler | None

    async def check_runs(self) -> None:
        s3 = self.stack.s3()
        baseline_digest = {r.job: r.final_digest for r in self.baselines.values()}
        jobs = {j.name: j for j in self.config.jobs}
        for record in self.runs.values():
            if record.outcome != "completed":
                continue
            keys = [(i["kind"], i["node"], i["rank"], i["attempt"]) for i in record.incidents
                    if i["kind"] != "straggler"]
            record.duplicate_incidents = [list(k) for k, n in Counter(keys).items() if n > 1]

            job = jobs[record.job]
            listing = await asyncio.to_thread(_manifest_steps, s3, record.prefix, record.workflow_id)
            record.manifests_left = sorted(listing)
            # Retention keeps the newest `keep_last` committed checkpoints: every step seen committed from
            # the oldest of those on must still have its manifest, the final checkpoint's included.
            committed = record.committed_seen | listing
            oldest_kept = min(sorted(committed)[-KEEP_LAST:], default=0)
            must_exist = {s for s in record.committed_seen if s >= oldest_kept}
            if record.final_step is not None:
                must_exist.add(record.final_step)
            lost = set()
            for step in sorted(must_exist):
                # The listing first; a HEAD of the very key has the last word.
                if step not in listing and not await asyncio.to_thread(
                        _exists, s3, manifest_key(record.prefix, record.workflow_id, step)):
                    lost.add(step)
            record.lost_steps = sorted(lost)
            # Not a lost commit, but worth knowing: a step of the cadence near the end that was never
            # committed at all (the final one, or one between the survivors), so a fault there would have
            # resumed from further back.
            cadence = range(max(job.every, oldest_kept), job.steps + 1, job.every)
            record.skipped_steps = sorted(s for s in cadence if s not in committed) or (
                [job.steps] if record.final_step != job.steps else [])
            expected = baseline_digest.get(record.job)
            record.digest_ok = record.final_digest is not None and record.final_digest == expected

    def nodes_taken_as_lost(self) -> list[dict[str, Any]]:
        """Each incident that took a node out of its run (a spare in its place, or the node cordoned), with the
        kills of the `LOST_NODE_LOOKBACK_S` before it. The soak only restarts components, so each one is a
        restart read as a lost node, unless the node's agent stayed away past the node timeout (its kill's
        `down_s` says)."""
        assert self.chaos is not None
        found = []
        for record in self.runs.values():
            for incident in record.incidents:
                if incident["kind"] != "node_unresponsive":
                    continue
                at_s = round(incident["detected_at"] - self.t0_wall, 1)
                found.append({
                    "workflow_id": record.workflow_id, "node": incident["node"], "at_s": at_s,
                    "action": incident["action"],
                    "kills_before": [f"{k.target} {k.signal} at {k.at_s}s (back after {k.down_s}s)"
                                     for k in self.chaos.kills if at_s - LOST_NODE_LOOKBACK_S <= k.at_s <= at_s]})
        return found

    def report(self) -> SoakReport:
        assert self.chaos is not None and self.sampler is not None
        runs = list(self.runs.values())
        kills = Counter(k.component for k in self.chaos.kills)
        kill_errors = [k for k in self.chaos.kills if k.error]
        completed = [r for r in runs if r.outcome == "completed"]
        failed = [r for r in runs if r.outcome == "failed"]
        unfinished = [r for r in runs if r.outcome in ("unfinished", "running")]
        incidents = Counter(i["kind"] for r in completed for i in r.incidents)
        duplicate_incidents = sum(len(r.duplicate_incidents) for r in completed)
        lost = sum(len(r.lost_steps) for r in completed)
        skipped = sum(len(r.skipped_steps) for r in completed)
        mismatched = [r for r in completed if not r.digest_ok]
        taken = self.nodes_taken_as_lost()
        duplicates = len(self.sampler.duplicates) + len(self.sampler.record_mismatches)
        commits_seen = sum(len(r.committed_seen) for r in completed)
        resumes = sum(r.resumes for r in runs)
        paused = [r for r in runs if "paused" in r.phases_seen]
        by_signal = {c: dict(Counter(k.signal for k in self.chaos.kills if k.component == c)) for c in COMPONENTS}
        recoveries = sorted(k.recovery_s for k in self.chaos.kills if k.recovery_s is not None)
        recovery = {"median": _quantile(recoveries, 0.5), "p95": _quantile(recoveries, 0.95),
                    "max": recoveries[-1] if recoveries else None,
                    "kills_before_recovery": sum(1 for k in self.chaos.kills if k.recovery_s is None)}
        kills_per_hour = round(len(self.chaos.kills) * 60 / self.config.minutes, 1)
        counts = {
            "seed": self.seed,
            "chaos_minutes": self.config.minutes,
            "kills": {c: kills.get(c, 0) for c in COMPONENTS},
            "kills_total": len(self.chaos.kills),
            "kills_by_signal": by_signal,
            "kills_per_hour": kills_per_hour,
            "recovery_s": recovery,
            "kill_errors": len(kill_errors),
            "runs_started": len(runs),
            "runs_completed": len(completed),
            "runs_failed": len(failed),
            "runs_unfinished": len(unfinished),
            "runs_paused": len(paused),
            "resumes_after_pause": resumes,
            "uncordons": self.uncordons,
            "incidents": dict(sorted(incidents.items())),
            "duplicate_rank_sets": duplicates,
            "duplicate_incidents": duplicate_incidents,
            "rank_samples": self.sampler.samples,
            "cross_node_stale_samples": self.sampler.cross_node_samples,
            "cross_node_stale_longest_s": self.sampler.cross_node_longest_s,
            "commits_observed": commits_seen,
            "checkpoints_lost": lost,
            "checkpoints_skipped": skipped,
            "digest_mismatches": len(mismatched),
            "nodes_taken_as_lost": len(taken),
        }
        failures = []
        if not runs:
            failures.append("no run was started")
        if failed:
            failures.append(f"{len(failed)} runs failed: "
                            + "; ".join(f"{r.workflow_id}: {r.reason}" for r in failed))
        if unfinished:
            failures.append(f"{len(unfinished)} runs unfinished: "
                            + ", ".join(r.workflow_id for r in unfinished))
        if duplicates:
            found = [asdict(d) for d in self.sampler.duplicates] + self.sampler.record_mismatches
            failures.append(f"{duplicates} duplicate rank sets: {found}")
        if duplicate_incidents:
            failures.append("incidents counted twice: " + "; ".join(
                f"{r.workflow_id}: {r.duplicate_incidents}" for r in completed if r.duplicate_incidents))
        if lost:
            failures.append("checkpoints lost: " + "; ".join(
                f"{r.workflow_id}: steps {r.lost_steps} (left: {r.manifests_left})"
                for r in completed if r.lost_steps))
        if mismatched:
            failures.append("final state differs from the baseline: "
                            + ", ".join(r.workflow_id for r in mismatched))
        if self.leftovers:
            failures.append(f"processes left after the stack was stopped: {', '.join(self.leftovers)}")
        if kill_errors:
            failures.append("components that did not come back: " + "; ".join(
                f"{k.target} at {k.at_s}s: {k.error}" for k in kill_errors))
        lines = [
            f"soak: {self.config.minutes:g} min of chaos, seed {self.seed}, "
            f"{self.config.pools} pool(s) of 3 nodes "
            f"({len(self.nodes)} nodes), jobs {', '.join(j.name for j in self.config.jobs)}",
            "kills: " + " ".join(f"{c}={kills.get(c, 0)}" for c in COMPONENTS)
            + f" (total {len(self.chaos.kills)}, {kills_per_hour:g}/h, {len(kill_errors)} did not come back; "
            + ", ".join(f"{c} {by_signal[c].get('SIGKILL', 0)} SIGKILL/{by_signal[c].get('SIGTERM', 0)} SIGTERM"
                        for c in COMPONENTS) + ")",
            f"recovery after a kill: median {recovery['median']}s, p95 {recovery['p95']}s, max {recovery['max']}s, "
            f"{recovery['kills_before_recovery']} kills came before the runs had recovered from the previous one",
            f"runs: started={len(runs)} completed={len(completed)} failed={len(failed)} "
            f"unfinished={len(unfinished)} "
            f"(paused: {len(paused)}; operator: {resumes} resumes after a pause, {self.uncordons} uncordons)",
            "incidents: " + (" ".join(f"{k}={v}" for k, v in sorted(incidents.items())) or "none")
            + f"; counted twice: {duplicate_incidents}",
            f"duplicates found: {duplicates} (rank samples {self.sampler.samples}; "
            f"live ranks of an older attempt "
            f"on a node the run had left: {self.sampler.cross_node_samples} samples, "
            f"longest {self.sampler.cross_node_longest_s}s)",
            f"checkpoints lost: {lost} (committed steps observed: {commits_seen}); "
            f"final state digest mismatches: {len(mismatched)}",
            *([f"warning: {skipped} checkpoints never committed (skipped, not lost): " + "; ".join(
                f"{r.workflow_id}: steps {r.skipped_steps} (manifests left: {r.manifests_left})"
                for r in completed if r.skipped_steps)] if skipped else []),
            *(f"warning: {t['node']} taken as lost by {t['workflow_id']} at {t['at_s']}s ({t['action']}); kills "
              f"in the {LOST_NODE_LOOKBACK_S:g} s before: {', '.join(t['kills_before']) or 'none'}" for t in taken),
            "result: " + ("PASS" if not failures else "FAIL"),
            *(f"  - {f}" for f in failures),
        ]
        data = {
            "counts": counts,
            "ok": not failures,
            "failures": failures,
            "config": {"minutes": self.config.minutes, "seed": self.seed, "pools": self.config.pools,
                       "gap_s": list(self.config.gap_s), "recovery_timeout_s": self.config.recovery_timeout_s,
                       "kills_per_hour": self.config.kills_per_hour,
                       "operator_grace_s": self.config.operator_grace_s, "jobs": [j.name for j in self.config.jobs],
                       "step_time": self.config.step_time, "nodes": list(self.nodes), "keep_last": KEEP_LAST,
                       "snapshot": self.config.snapshot, "home": str(self.stack.home)},
            "leftovers": self.leftovers,
            "kills": [asdict(k) for k in self.chaos.kills],
            "baselines": [r.to_json() for r in self.baselines.values()],
            "runs": [r.to_json() for r in runs],
            "nodes_taken_as_lost": taken,
            "duplicates": [asdict(d) for d in self.sampler.duplicates],
            "record_mismatches": self.sampler.record_mismatches,
            "errors": self.errors,
        }
        return SoakReport(not failures, counts, failures, lines, data)


def _quantile(values: list[float], q: float) -> float | None:
    """The `q` quantile of sorted `values` (nearest rank); None when empty."""
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def _manifest_steps(s3: Any, prefix: str, workflow_id: str) -> set[int]:
    steps = set()
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/{workflow_id}/")
    for page in pages:
        for item in page.get("Contents", []):
            parts = item["Key"].rsplit("/", 2)
            if len(parts) == 3 and parts[2] == "manifest.json" and parts[1].startswith("step-"):
                steps.add(int(parts[1][len("step-"):]))
    return steps


def _exists(s3: Any, key: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        s3.head_object(Bucket=BUCKET, Key=key)
        return True
    except ClientError:
        return False
