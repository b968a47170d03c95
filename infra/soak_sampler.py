"""The soak's duplicate-rank watch: samples the stack's live ranks (found by `infra.harness` in the agents'
records and /proc), looking for two attempts of one run alive on a node at once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from infra import harness
from infra.harness import RankProc, scan_ranks
from infra.harness import alive as _alive
from infra.soak_model import Duplicate


class RankSampler:
    """Samples the live ranks of the stack, looking for two attempts of one run alive on a node at once."""

    def __init__(self, home: Path, clock: Callable[[], float]) -> None:
        self.home = home
        self.clock = clock
        self.samples = 0
        self.record_samples = 0
        self.duplicates: list[Duplicate] = []
        self.record_mismatches: list[dict[str, Any]] = []
        self.cross_node_samples = 0
        """Samples where a run had live ranks of two attempts on different nodes: a killed agent's orphans
        on a node the run has left, beside the newer attempt. Expected briefly by design (an unreachable
        node is fenced by its agent at its next launch; the orphans die when their peers are stopped).
        Reported, not an invariant."""
        self.cross_node_longest_s = 0.0
        self._cross_since: dict[str, float] = {}
        self._seen: set[tuple[Any, ...]] = set()

    def sample(self) -> None:
        procs = scan_ranks(self.home)
        self.samples += 1
        by_run_node: dict[tuple[str, str], list[RankProc]] = {}
        for proc in procs:
            by_run_node.setdefault((proc.workflow_id, proc.node), []).append(proc)
        for (workflow_id, node), group in sorted(by_run_node.items()):
            attempts = sorted({p.attempt for p in group})
            if len(attempts) < 2:
                continue
            # Confirm: an older attempt's process is still alive now that a newer one has been seen alive
            # (the scan reads processes one by one; an old rank may have exited between two reads).
            newest = attempts[-1]
            older_alive = [p for p in group if p.attempt < newest and _alive(p.pid, p.start_time)]
            newer_alive = [p for p in group if p.attempt == newest and _alive(p.pid, p.start_time)]
            if not older_alive or not newer_alive:
                continue
            key = ("node", workflow_id, node, tuple(attempts))
            if key not in self._seen:
                self._seen.add(key)
                self.duplicates.append(Duplicate(
                    workflow_id, node, attempts,
                    {str(a): sorted(p.pid for p in group if p.attempt == a) for a in attempts},
                    round(self.clock(), 1)))

        # Across nodes (informational).
        by_run: dict[str, set[int]] = {}
        for proc in procs:
            by_run.setdefault(proc.workflow_id, set()).add(proc.attempt)
        now = self.clock()
        overlapping = {w for w, attempts in by_run.items() if len(attempts) > 1}
        if overlapping:
            self.cross_node_samples += 1
        for workflow_id in overlapping:
            since = self._cross_since.setdefault(workflow_id, now)
            self.cross_node_longest_s = max(self.cross_node_longest_s, round(now - since, 1))
        for workflow_id in list(self._cross_since):
            if workflow_id not in overlapping:
                del self._cross_since[workflow_id]

        # The agents' own records: while the ranks a record names are alive, every live process of that run
        # on that node belongs to the recorded attempt.
        for node, record in harness.agent_records(self.home):
            self.record_samples += 1
            ranks = record.ranks
            if not any(_alive(i.pid, i.start_time) for i in ranks):
                continue
            strays = [p for p in by_run_node.get((record.workflow_id, node), [])
                      if p.attempt != record.attempt and _alive(p.pid, p.start_time)]
            # Re-read: the recorded ranks may have been fenced (and the record moved on) meanwhile.
            if not strays or not any(_alive(i.pid, i.start_time) for i in ranks):
                continue
            key = ("record", record.workflow_id, node, record.attempt,
                   tuple(sorted({p.attempt for p in strays})))
            if key not in self._seen:
                self._seen.add(key)
                self.record_mismatches.append({
                    "workflow_id": record.workflow_id, "node": node,
                    "recorded_attempt": record.attempt,
                    "stray_attempts": sorted({p.attempt for p in strays}),
                    "stray_pids": sorted(p.pid for p in strays), "at_s": round(self.clock(), 1)})
