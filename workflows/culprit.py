"""Which rank caused a hang, from every rank's evidence: a pure rule, tested with tables.

When one rank stalls, its peers soon stall too, waiting for it in the next collective: every rank goes
silent, and progress alone cannot say which one is to blame. The evidence each rank gave before anything was
stopped can (`activities.evidence`):

1. a rank whose process cannot run (stopped `T`, in uninterruptible I/O `D`, defunct `Z`);
2. else a rank that is not inside a collective while its peers are (or that alone did not answer while its
   peers answered from inside one): the one they wait for;
3. else, all inside one, the rank behind in sequence (fewest collectives entered): its peers entered one it
   never reached;
4. else the rank the watch found silent longest (no evidence told them apart).

Where several ranks fit a rule, the one behind in sequence, then the watch's own pick, then the lowest rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from activities.models import RankEvidence

STUCK_STATES = frozenset({"T", "t", "D", "Z"})
_STATE_WORDS = {"T": "stopped", "t": "stopped (traced)", "D": "in uninterruptible I/O", "Z": "defunct"}


@dataclass(frozen=True, slots=True)
class Culprit:
    rank: int | None
    node: str | None
    rule: str
    """`process-state`, `outside-collective`, `no-answer`, `behind-in-sequence`, or `silent-longest`."""
    evidence: str
    """One or two lines for the incident: why this rank, its innermost frames, and where its peers wait."""


def _order(candidates: list[RankEvidence], fallback: int | None) -> RankEvidence:
    return min(candidates, key=lambda e: (e.collectives_enqueued if e.collectives_enqueued is not None else 1 << 62,
                                          e.rank != fallback, e.rank))


def _where(item: RankEvidence) -> str:
    return item.innermost or "no stacks"


def _peers_line(peers: list[RankEvidence]) -> str:
    inside = [p for p in peers if p.in_collective]
    if not peers:
        return "no peers answered"
    if inside:
        first = min(inside, key=lambda p: p.rank)
        seq = f" #{first.collectives_enqueued}" if first.collectives_enqueued is not None else ""
        return (f"{len(inside)} of {len(peers)} peers wait inside {first.collective or 'a collective'}{seq} "
                f"(rank {first.rank}: {_where(first)})")
    first = min(peers, key=lambda p: p.rank)
    return f"peers: rank {first.rank} {first.state or '?'} at {_where(first)}"


def _named(pick: RankEvidence, evidence: list[RankEvidence], rule: str, why: str) -> Culprit:
    peers = [e for e in evidence if e.rank != pick.rank and e.state != "exited"]
    if pick.innermost:
        where = f", at {pick.innermost}"
    elif pick.state in STUCK_STATES:
        where = f" (a process that is {_STATE_WORDS.get(pick.state, pick.state)} cannot give its stacks)"
    else:
        where = " (it gave no stacks)"
    return Culprit(rank=pick.rank, node=pick.node, rule=rule,
                   evidence=f"rank {pick.rank} {why}{where}\n{_peers_line(peers)}")


def pick_culprit(evidence: list[RankEvidence], fallback_rank: int | None,
                 fallback_node: str | None) -> Culprit:
    """The culprit of a hang from every rank's evidence; `fallback_*` is the rank the watch judged hung."""
    live = [e for e in evidence if e.state != "exited"]
    stuck = [e for e in live if e.state in STUCK_STATES]
    if stuck:
        pick = _order(stuck, fallback_rank)
        return _named(pick, evidence, "process-state", f"is {_STATE_WORDS.get(pick.state, pick.state)}")

    known = [e for e in live if e.in_collective is not None]
    inside = [e for e in known if e.in_collective]
    outside = [e for e in known if not e.in_collective]
    if inside and outside:
        pick = _order(outside, fallback_rank)
        return _named(pick, evidence, "outside-collective",
                      f"is not inside a collective (entered {pick.collectives_enqueued}) while its peers are")
    silent = [e for e in live if not e.answered]
    if inside and silent and len(inside) + len(silent) == len(live):
        pick = _order(silent, fallback_rank)
        return _named(pick, evidence, "no-answer", "did not answer while its peers answered from a collective")

    counted = [e for e in known if e.collectives_enqueued is not None]
    if len(counted) > 1:
        lowest = min(e.collectives_enqueued for e in counted)  # type: ignore[type-var]  # counted: all known
        if lowest < max(e.collectives_enqueued for e in counted):  # type: ignore[type-var, operator]  # as above
            behind = [e for e in counted if e.collectives_enqueued == lowest]
            pick = _order(behind, fallback_rank)
            return _named(pick, evidence, "behind-in-sequence",
                          f"is behind in sequence (entered {lowest} collectives, its peers more)")

    by_rank = {e.rank: e for e in evidence}
    if fallback_rank in by_rank:
        return _named(by_rank[fallback_rank], evidence, "silent-longest",
                      "was silent longest (the evidence did not tell the ranks apart)")
    return Culprit(rank=fallback_rank, node=fallback_node, rule="silent-longest",
                   evidence="no evidence from the ranks (none answered)" if evidence else "")
