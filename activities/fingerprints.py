"""Silent data corruption, found by comparing replicas: ranks that must hold bit-identical state report its
fingerprint (`trainguard.numerics`), each node's watch writes its ranks' newest to the store
(`FingerprintRecord`, `<run prefix>/fingerprints/<node>.json`, overwritten), and the committer, which reads the
store anyway, compares them across nodes and answers the run with the first step replicas differ at
(`CorruptionVerdict`). Nothing passes through Temporal while replicas agree.

Committed checkpoints carry the same fingerprints (each shard's meta, then the manifest's shard list): a
checkpoint whose replicas disagree is never restored (`fingerprint_problem`).

`compare` and `fingerprint_problem` are pure: tests/unit/test_fingerprints.py.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from activities.checkpoint_layout import FINGERPRINT_TAG_CONTEXT
from activities.fingerprint_models import CorruptionVerdict, FingerprintRecord
from activities.store_reads import read_signed_records
from trainguard.numerics import Fingerprint

FINGERPRINT_DIR = "fingerprints"

FINGERPRINT_WRITE_MIN_S = 1.0
"""A node writes its record at most this often, and a tenth of a straggler window in a large run (whose window
widens with its nodes): one write per node per fingerprint interval costs the store little, and a corruption is
seen within seconds of the fingerprint that shows it."""


def fingerprint_key(run_prefix: str, node: str) -> str:
    return f"{run_prefix}/{FINGERPRINT_DIR}/{node}.json"


def write_interval_s(straggler_window_s: float) -> float:
    return max(FINGERPRINT_WRITE_MIN_S, straggler_window_s / 10)


def _parsed(items: Iterable[Any]) -> list[Fingerprint]:
    found: list[Fingerprint] = []
    for item in items:
        try:
            found.append(Fingerprint.from_json(item))
        except (TypeError, ValueError, IndexError):
            continue
    return found


def disagreement(values: Mapping[int, Fingerprint]) -> tuple[list[int], bool] | None:
    """Of ranks' fingerprints at one step in one group: the ranks that differ from the majority (and True), or,
    with no majority (two replicas, or an even split), every rank not in the largest agreeing set (and False);
    None when they all agree."""
    counts = Counter(f.value for f in values.values())
    if len(counts) <= 1:
        return None
    (top, top_count), *rest = counts.most_common()
    certain = top_count * 2 > len(values)
    if certain:
        return sorted(r for r, f in values.items() if f.value != top), True
    if len(values) == 2:
        return sorted(values), False
    return sorted(r for r, f in values.items() if f.value != top), False


def compare(ranks: Mapping[int, Iterable[Any]], nodes: Mapping[int, str], now: float,
            after_step: int = -1) -> CorruptionVerdict | None:
    """The first step after `after_step` at which ranks of one group (replicas) report different fingerprints,
    from each rank's newest fingerprints (JSON); None while every group agrees on every step all its ranks
    reported. A step is judged only once every rank of its group has reported it: nodes write their records at
    their own moments, and two ranks of one node compared without the others would be two replicas with no
    majority. A rank alone in its group (pure FSDP) is compared with nobody."""
    by_step: dict[tuple[int, str], dict[int, Fingerprint]] = defaultdict(dict)
    members: dict[str, set[int]] = defaultdict(set)
    for rank, items in ranks.items():
        for taken in _parsed(items):
            members[taken.group].add(rank)
            if taken.step > after_step:
                by_step[(taken.step, taken.group)][rank] = taken
    agreed: dict[str, int] = {}
    for (step, group), values in sorted(by_step.items()):
        if len(values) < 2 or len(values) < len(members[group]):
            continue
        found = disagreement(values)
        if found is None:
            agreed[group] = step
            continue
        bad, certain = found
        return CorruptionVerdict(step=step, last_good_step=agreed.get(group, -1), ranks=bad,
                                 nodes={r: nodes.get(r, "") for r in bad}, group=group, certain=certain,
                                 found_at=now)
    return None


def judge_records(records: Iterable[FingerprintRecord], *, now: float, chain_id: str = "", min_attempt: int = 0,
                  attempt: int | None = None, after_step: int = -1) -> CorruptionVerdict | None:
    """`compare` over the nodes' records of the run's current attempts (`min_attempt`..`attempt`, of its chain):
    a relaunch's ranks fingerprint the steps again, and the diverged attempt's records say nothing of them."""
    ranks: dict[int, list[list[object]]] = {}
    nodes: dict[int, str] = {}
    for record in records:
        if (chain_id and record.chain_id and record.chain_id != chain_id) or record.attempt < min_attempt or (
                attempt is not None and record.attempt > attempt):
            continue
        for rank, items in record.ranks.items():
            ranks[rank] = items
            nodes[rank] = record.node
    return compare(ranks, nodes, now, after_step)


def fingerprint_problem(shards: Iterable[Any]) -> str | None:
    """Why a checkpoint's replicas disagree (its shards' fingerprints, each taken at the checkpoint's step), or
    None: a checkpoint a corrupt replica wrote, or one written after replicas diverged, is never restored."""
    values: dict[str, dict[int, Fingerprint]] = defaultdict(dict)
    for shard in shards:
        if shard.fingerprint is None:
            continue
        parsed = _parsed([shard.fingerprint])
        if parsed:
            values[parsed[0].group][shard.rank] = parsed[0]
    for group, found in sorted(values.items()):
        bad = disagreement(found) if len(found) > 1 else None
        if bad is not None:
            return (f"replicas disagree: rank(s) {', '.join(map(str, bad[0]))} hold other state than their replicas "
                    f"({group}) at this step")
    return None


def read_fingerprints(client: Any, bucket: str, run_prefix: str,
                      cache: dict[str, tuple[str, FingerprintRecord | None]],
                      token: str | None = None) -> list[FingerprintRecord]:
    """Every node's `FingerprintRecord` under the run's prefix (`read_signed_records`)."""
    return read_signed_records(client, bucket, f"{run_prefix}/{FINGERPRINT_DIR}/", FingerprintRecord,
                               FINGERPRINT_TAG_CONTEXT, cache, token)
