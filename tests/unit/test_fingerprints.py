"""Replicas compared by their fingerprints (`activities.fingerprints`), and what the watch reads of the ranks'
numbers (`activities.progress.numerical_fault`, `new_fingerprints`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from activities import rank_watch
from activities.fingerprint_models import FingerprintRecord
from activities.health import NodeHealth
from activities.fingerprints import compare, fingerprint_problem, judge_records, settle
from activities.models import ShardInfo
from activities.progress import RankReport, new_fingerprints, numerical_fault
from activities.rank_records import AttemptRecord, RankBook
from activities.rank_watch import RankWatch
from trainguard.numerics import Fingerprint
from trainguard.protocol import RunLayout

GOOD, BAD = "00000000000000aa", "00000000000000bb"


def fp(step: int, value: str = GOOD, group: str = "replicated") -> list[Any]:
    return [step, value, group]


NODES = {0: "node-0", 1: "node-0", 2: "node-1", 3: "node-1"}


def test_replicas_that_agree_give_no_verdict() -> None:
    assert compare({r: [fp(10), fp(20)] for r in range(4)}, NODES, now=1.0) is None


def test_the_minority_replica_is_named_with_its_node_and_the_last_step_all_agreed() -> None:
    ranks = {0: [fp(10), fp(20)], 1: [fp(10), fp(20)], 2: [fp(10), fp(20, BAD)], 3: [fp(10), fp(20)]}
    verdict = compare(ranks, NODES, now=5.0)
    assert verdict is not None
    assert (verdict.step, verdict.last_good_step, verdict.ranks, verdict.nodes, verdict.certain) == (
        20, 10, [2], {2: "node-1"}, True)


def test_the_first_step_replicas_differ_at_is_the_verdict() -> None:
    ranks = {0: [fp(10), fp(20, "c")], 1: [fp(10), fp(20)], 2: [fp(10, BAD), fp(20, BAD)], 3: [fp(10), fp(20)]}
    verdict = compare(ranks, NODES, now=5.0)
    assert verdict is not None and verdict.step == 10 and verdict.ranks == [2]


def test_two_replicas_that_differ_are_both_suspects_and_not_certain() -> None:
    verdict = compare({0: [fp(10, group="shard 0/2")], 2: [fp(10, BAD, group="shard 0/2")],
                       1: [fp(10, group="shard 1/2")], 3: [fp(10, group="shard 1/2")]}, NODES, now=1.0)
    assert verdict is not None
    assert (verdict.ranks, verdict.certain, verdict.group) == ([0, 2], False, "shard 0/2")


def test_ranks_alone_in_their_group_are_compared_with_nobody() -> None:
    # Pure FSDP: every rank holds its own shard; nothing to compare, nothing to report.
    assert compare({r: [fp(10, f"{r:016x}", group=f"rank {r}")] for r in range(4)}, NODES, now=1.0) is None


def test_a_step_only_one_replica_reported_yet_waits() -> None:
    assert compare({0: [fp(10), fp(20)], 1: [fp(10), fp(30, BAD)]}, NODES, now=1.0) is None


def test_a_step_only_one_nodes_ranks_reported_waits_for_the_others() -> None:
    # node-1 wrote step 30 before node-0 did: its two ranks alone would be two replicas with no majority.
    early = {0: [fp(20)], 1: [fp(20)], 2: [fp(20), fp(30, BAD)], 3: [fp(20), fp(30)]}
    assert compare(early, NODES, now=1.0) is None
    verdict = compare({**early, 0: [fp(20), fp(30)], 1: [fp(20), fp(30)]}, NODES, now=2.0)
    assert verdict is not None and (verdict.ranks, verdict.certain) == ([2], True)


def test_records_of_another_attempt_or_chain_are_left_out() -> None:
    def record(node: str, attempt: int, ranks: dict[int, list[list[Any]]], chain: str = "c1") -> FingerprintRecord:
        return FingerprintRecord(node=node, attempt=attempt, chain_id=chain, written_at=0.0, ranks=ranks)

    diverged = [record("node-0", 1, {0: [fp(10)], 1: [fp(10)]}), record("node-1", 1, {2: [fp(10, BAD)], 3: [fp(10)]})]
    assert judge_records(diverged, now=1.0, chain_id="c1", min_attempt=1, attempt=1) is not None
    assert judge_records(diverged, now=1.0, chain_id="c1", min_attempt=2, attempt=2) is None  # after the relaunch
    assert judge_records(diverged, now=1.0, chain_id="c2", min_attempt=1, attempt=1) is None


def test_a_checkpoint_whose_replicas_disagree_is_refused() -> None:
    def shard(rank: int, value: str | None) -> ShardInfo:
        return ShardInfo(rank=rank, size_bytes=0, sha256="", replica_of=0 if rank else None,
                         fingerprint=None if value is None else fp(50, value))

    assert fingerprint_problem([shard(0, GOOD), shard(1, GOOD), shard(2, GOOD)]) is None
    assert fingerprint_problem([shard(0, GOOD), shard(1, None)]) is None  # a script without the line
    problem = fingerprint_problem([shard(0, BAD), shard(1, GOOD), shard(2, GOOD)])
    assert problem is not None and "rank(s) 0" in problem


def report(rank: int, **fields: Any) -> RankReport:
    return RankReport(rank=rank, step=5, time=0.0, **fields)


@pytest.mark.parametrize(("numerical", "expected"), [
    ({}, None),
    ({1: {"step": 7, "detail": "loss is nan"}}, 1),
    ({0: {"step": 8, "detail": "loss is nan"}, 1: {"step": 7, "detail": "loss is inf"}}, 1),  # the earliest step
])
def test_numerical_fault_names_the_rank_with_the_earliest_bad_step(numerical: dict[int, Any],
                                                                   expected: int | None) -> None:
    found = numerical_fault({r: report(r, numerical=numerical.get(r)) for r in (0, 1)})
    assert (None if found is None else found[0]) == expected


def test_new_fingerprints_only_when_some_rank_has_a_newer_one() -> None:
    reports: dict[int, RankReport | None] = {0: report(0, fingerprints=[fp(10)]), 1: report(1, fingerprints=[fp(10)])}
    assert new_fingerprints(reports, {}) == {0: [fp(10)], 1: [fp(10)]}
    assert new_fingerprints(reports, {0: 10, 1: 10}) is None
    reports[1] = report(1, fingerprints=[fp(10), fp(20)])
    assert new_fingerprints(reports, {0: 10, 1: 10}) == {0: [fp(10)], 1: [fp(10), fp(20)]}


async def test_a_sick_gpu_flips_a_bit_once_in_every_attempt_after_its_first_fingerprint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flipped: list[tuple[int, int, str]] = []
    monkeypatch.setattr(rank_watch, "inject_numeric",
                        lambda _layout, record, rank, fault: flipped.append((record.attempt, rank, str(fault))))
    health = NodeHealth()
    watch = RankWatch(RankBook("node-1", tmp_path), launch=None, health=health)  # type: ignore[arg-type]
    layout = RunLayout.of(tmp_path, "run")

    async def look(attempt: int, reports: dict[int, RankReport | None]) -> None:
        record = AttemptRecord(workflow_id="run", attempt=attempt, master_addr="", master_port=0, start_step=0,
                               launched_at=0.0, chain_id="c1")
        watch._flip_again(record, layout, reports)
        await asyncio.sleep(0.05)  # the flip runs in a thread

    health.flips_bits, health.flipped = True, {("run", "c1", 1)}  # chaos flipped attempt 1 itself
    await look(1, {2: report(2, fingerprints=[fp(10)])})
    await look(2, {2: report(2), 3: report(3)})  # attempt 2 has not fingerprinted yet: nothing to flip
    await look(2, {2: report(2), 3: report(3, fingerprints=[fp(30)])})
    await look(2, {2: report(2, fingerprints=[fp(40)]), 3: report(3, fingerprints=[fp(40)])})  # once only
    assert flipped == [(2, 3, "bitflip")]


# ---------------------------------------------------------------- two replicas told apart by their replay
# HSDP, 2 replicas x 2 shards: node-0 holds replica 0 (ranks 0, 1), node-1 replica 1 (ranks 2, 3). A bit flipped on
# rank 2 after step 33: replica 1's losses go wrong from step 34, replica 0's from 35 (the all-reduce of 34).
TRUTH = {s: float(100 - s).hex() for s in range(31, 41)}


def trail(wrong_from: int | None) -> list[list[Any]]:
    return [[s, float(-s).hex() if wrong_from is not None and s >= wrong_from else loss]
            for s, loss in TRUTH.items()]


def hsdp(values: dict[int, str], wrong_from: dict[int, int | None], step: int = 40) -> dict[int, list[Any]]:
    """Each rank's fingerprints at 30 (all agree) and `step` (its value there, its losses since 30)."""
    return {r: [fp(30, GOOD, f"shard {r % 2}/2"), [*fp(step, values[r], f"shard {r % 2}/2"), trail(wrong_from[r])]]
            for r in range(4)}


def tied(values: dict[int, str], wrong_from: dict[int, int | None]) -> Any:
    verdict = compare(hsdp(values, wrong_from), NODES, now=1.0)
    assert verdict is not None and not verdict.certain and verdict.evidence is not None
    return verdict.evidence


FLIPPED_ON_2 = {0: 35, 1: 35, 2: 34, 3: 34}


def test_a_tie_keeps_what_both_replicas_held_and_every_loss_their_nodes_reported() -> None:
    evidence = tied({0: "a1", 1: GOOD, 2: "b2", 3: GOOD}, FLIPPED_ON_2)
    assert (evidence.step, evidence.last_good_step, evidence.group, evidence.agreed) == (40, 30, "shard 0/2", GOOD)
    assert evidence.values == {0: "a1", 2: "b2"} and evidence.nodes == {"node-0": [0, 1], "node-1": [2, 3]}
    assert sorted(evidence.trails) == [0, 1, 2, 3] and sorted(evidence.trails[2]) == list(range(31, 41))


def test_the_replica_whose_losses_leave_the_replays_first_is_named() -> None:
    evidence = tied({0: "a1", 1: GOOD, 2: "b2", 3: GOOD}, FLIPPED_ON_2)
    replay = hsdp({r: "c3" for r in range(4)}, dict.fromkeys(range(4)))  # both states went wrong: neither is c3
    settled = settle(evidence, replay)
    assert settled is not None and (settled.node, settled.rank) == ("node-1", 2), settled
    assert "step 34" in settled.why and "step 35" in settled.why


def test_a_flip_on_rank_3_names_node_1_through_rank_3s_loss() -> None:
    # the flipped element lies in rank 2's shard, but rank 3's batch was the one to use it first
    evidence = tied({0: "a1", 1: GOOD, 2: "b2", 3: GOOD}, {0: 36, 1: 36, 2: 36, 3: 35})
    settled = settle(evidence, hsdp({r: "c3" for r in range(4)}, dict.fromkeys(range(4))))
    assert settled is not None and settled.node == "node-1"


def test_the_replica_whose_state_the_replay_reaches_was_right() -> None:
    # the flipped element was in no batch: replica 0 was never poisoned, and no loss shows it
    evidence = tied({0: "a1", 1: GOOD, 2: "b2", 3: GOOD}, dict.fromkeys(range(4)))
    settled = settle(evidence, hsdp({r: "a1" for r in range(4)}, dict.fromkeys(range(4))))
    assert settled is not None and (settled.node, settled.rank) == ("node-1", 2) and "rank 0's state" in settled.why


@pytest.mark.parametrize(("wrong_from", "replay_values", "why"), [
    pytest.param({0: 35, 1: 35, 2: 35, 3: 35}, {r: "c3" for r in range(4)}, "do not tell", id="same-step"),
    pytest.param(FLIPPED_ON_2, {0: "c3", 1: GOOD, 2: "d4", 3: GOOD}, "differ at step 40 too", id="replay-differs"),
])
def test_a_replay_that_cannot_tell_them_apart_names_nobody(wrong_from: dict[int, int | None],
                                                           replay_values: dict[int, str], why: str) -> None:
    evidence = tied({0: "a1", 1: GOOD, 2: "b2", 3: GOOD}, wrong_from)
    settled = settle(evidence, hsdp(replay_values, dict.fromkeys(range(4))))
    assert settled is not None and settled.node is None and why in settled.why


def test_a_replay_that_misses_the_agreed_state_is_not_deterministic_and_names_nobody() -> None:
    evidence = tied({0: "a1", 1: GOOD, 2: "b2", 3: GOOD}, FLIPPED_ON_2)
    replay = hsdp({r: "c3" for r in range(4)}, dict.fromkeys(range(4)))
    for items in replay.values():
        items[0] = fp(30, BAD, items[0][2])
    settled = settle(evidence, replay)
    assert settled is not None and settled.node is None and "not deterministic" in settled.why


def test_a_replay_short_of_the_step_waits_and_one_past_it_unseen_gives_up() -> None:
    evidence = tied({0: "a1", 1: GOOD, 2: "b2", 3: GOOD}, FLIPPED_ON_2)
    assert settle(evidence, hsdp({r: "c3" for r in range(4)}, dict.fromkeys(range(4)), step=35)) is None
    past = {r: [fp(50, "c3", f"shard {r % 2}/2")] for r in range(4)}
    settled = settle(evidence, past)
    assert settled is not None and settled.node is None and "not seen" in settled.why


def test_a_fingerprint_carries_its_losses_through_json() -> None:
    taken = Fingerprint(step=40, value=GOOD, group="replicated", losses=((39, (0.5).hex()), (40, (0.25).hex())))
    assert Fingerprint.from_json(json.loads(json.dumps(taken.to_json()))) == taken
    assert Fingerprint.from_json([40, GOOD, "replicated"]).losses == ()
