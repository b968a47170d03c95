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
from activities.fingerprint_models import CorruptionVerdict, FingerprintRecord, TieEvidence, TieSettlement
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
    agreed: dict[str, tuple[int, str]] = {}
    for (step, group), values in sorted(by_step.items()):
        if len(values) < 2 or len(values) < len(members[group]):
            continue
        found = disagreement(values)
        if found is None:
            agreed[group] = (step, next(iter(values.values())).value)
            continue
        bad, certain = found
        good, good_value = agreed.get(group, (-1, None))
        evidence = None if certain else _evidence(by_step, step, group, good, good_value, bad, nodes)
        return CorruptionVerdict(step=step, last_good_step=good, ranks=bad,
                                 nodes={r: nodes.get(r, "") for r in bad}, group=group, certain=certain,
                                 found_at=now, evidence=evidence)
    return None


def _evidence(by_step: Mapping[tuple[int, str], Mapping[int, Fingerprint]], step: int, group: str, good: int,
              good_value: str | None, bad: list[int], nodes: Mapping[int, str]) -> TieEvidence:
    """What the two replicas held and reported at `step`: their fingerprints, and every rank's losses on their
    nodes since `good` (each rank's fingerprint at `step`, whatever its group, carries them)."""
    suspects = sorted({nodes.get(r, "") for r in bad})
    on = {node: sorted(r for r, n in nodes.items() if n == node) for node in suspects}
    taken = {r: f for (at, _), values in by_step.items() if at == step for r, f in values.items()}
    trails = {r: {s: loss for s, loss in taken[r].losses if s > good}
              for ranks in on.values() for r in ranks if r in taken}
    return TieEvidence(step=step, last_good_step=good, group=group, agreed=good_value, nodes=on, trails=trails,
                       values={r: by_step[(step, group)][r].value for r in bad})


def settle(evidence: TieEvidence, ranks: Mapping[int, Iterable[Any]]) -> TieSettlement | None:
    """The replay's answer to two replicas that differed with no majority (`Tie`), from its ranks' newest
    fingerprints (JSON); None until every rank of the two nodes has fingerprinted the step they differed at.

    The replay computes what the fault-free run does. The replica whose fingerprint at that step it reaches was
    right. Failing that (the all-reduce after a flip took both away from it), the replica a bit flipped in
    computed its next loss wrong, and the other only the loss after (its state went wrong at that all-reduce):
    the node whose ranks' losses leave the replay's first computed wrong. Anything else names nobody: the replay
    went wrong itself, or is not deterministic, or both went wrong at once."""
    replay = {r: {f.step: f for f in _parsed(items)} for r, items in ranks.items()}
    needed = [r for on in evidence.nodes.values() for r in on]
    if any(evidence.step not in replay.get(r, {}) for r in needed):
        if needed and all(replay.get(r) and min(replay[r]) > evidence.step for r in needed):
            return TieSettlement(why=f"the replay's fingerprints of step {evidence.step} were not seen")
        return None
    at_step = {r: replay[r][evidence.step] for r in evidence.values}
    truth = {f.value for f in at_step.values()}
    if len(truth) != 1:
        return TieSettlement(why=f"the replay's replicas differ at step {evidence.step} too")
    before = [replay[r].get(evidence.last_good_step) for r in evidence.values]
    if evidence.agreed is not None and any(f is not None and f.value != evidence.agreed for f in before):
        return TieSettlement(why=f"the replay does not reach the state both held at step {evidence.last_good_step}: "
                                 "training is not deterministic here")
    node_of = {r: node for node, on in evidence.nodes.items() for r in on}
    right = [r for r, value in evidence.values.items() if value in truth]
    if len(right) == 1:
        [wrong] = [r for r in evidence.values if r not in right]
        return TieSettlement(node=node_of.get(wrong), rank=wrong, why=(
            f"the replay reached rank {right[0]}'s state at step {evidence.step}, not rank {wrong}'s"))
    first = {node: _first_wrong_loss(evidence, replay, on) for node, on in evidence.nodes.items()}
    ranked = sorted((step, node) for node, step in first.items() if step is not None)
    if len(evidence.nodes) != 2 or not ranked or (len(ranked) == 2 and ranked[0][0] == ranked[1][0]):
        return TieSettlement(why="the replay's losses do not tell the two apart")
    step, node = ranked[0]
    other = next(n for n in evidence.nodes if n != node)
    later = first[other]
    return TieSettlement(node=node, rank=next((r for r in evidence.values if node_of.get(r) == node), None), why=(
        f"in the replay, {node}'s ranks computed their loss of step {step} differently from the attempt that "
        f"diverged, and {other}'s " + (f"only from step {later}" if later is not None else "never")
        + ": the flip was on " + node))


def _first_wrong_loss(evidence: TieEvidence, replay: Mapping[int, Mapping[int, Fingerprint]],
                      ranks: list[int]) -> int | None:
    """The first step after the last agreement at which one of `ranks` reported a loss the replay did not."""
    wrong = []
    for rank in ranks:
        replayed = dict(replay[rank][evidence.step].losses)
        for step, loss in sorted(evidence.trails.get(rank, {}).items()):
            if step in replayed and replayed[step] != loss:
                wrong.append(step)
                break
    return min(wrong, default=None)


def judge_records(records: Iterable[FingerprintRecord], *, now: float, chain_id: str = "", min_attempt: int = 0,
                  attempt: int | None = None, after_step: int = -1) -> CorruptionVerdict | None:
    """`compare` over the nodes' records of the run's current attempts (`min_attempt`..`attempt`, of its chain):
    a relaunch's ranks fingerprint the steps again, and the diverged attempt's records say nothing of them."""
    ranks, nodes = _current(records, chain_id, min_attempt, attempt)
    return compare(ranks, nodes, now, after_step)


def settle_records(records: Iterable[FingerprintRecord], evidence: TieEvidence, *, chain_id: str = "",
                   min_attempt: int = 0, attempt: int | None = None) -> TieSettlement | None:
    """`settle` over the nodes' records of the run's current attempts (the replay)."""
    ranks, _ = _current(records, chain_id, min_attempt, attempt)
    return settle(evidence, ranks)


def _current(records: Iterable[FingerprintRecord], chain_id: str, min_attempt: int,
             attempt: int | None) -> tuple[dict[int, list[list[object]]], dict[int, str]]:
    ranks: dict[int, list[list[object]]] = {}
    nodes: dict[int, str] = {}
    for record in records:
        if (chain_id and record.chain_id and record.chain_id != chain_id) or record.attempt < min_attempt or (
                attempt is not None and record.attempt > attempt):
            continue
        for rank, items in record.ranks.items():
            ranks[rank] = items
            nodes[rank] = record.node
    return ranks, nodes


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
