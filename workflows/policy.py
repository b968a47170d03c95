"""Pure decisions of a `TrainingRun`: what to do about an incident, and which phase may follow which.

No I/O, no clock reads: the time is an argument. Tested with tables in tests/unit/test_policy.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainguard.models import Action, CheckpointRef, Incident, IncidentKind, Phase
from trainguard.rank import EXIT_NO_RETRY
from trainguard.spec import RunSpec

# --------------------------------------------------------------------------------------------- phases

ALLOWED_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    # A run continued as new goes straight back to watching the ranks it already runs.
    Phase.VALIDATING: frozenset({Phase.RESERVING, Phase.RUNNING, Phase.FAILED}),
    Phase.RESERVING: frozenset({Phase.RESTORING, Phase.FAILED}),
    Phase.RESTORING: frozenset({Phase.LAUNCHING, Phase.RESTORING, Phase.RECOVERING, Phase.FAILED}),
    Phase.LAUNCHING: frozenset({Phase.RUNNING, Phase.RECOVERING, Phase.FAILED}),
    Phase.RUNNING: frozenset({Phase.RECOVERING, Phase.PAUSED, Phase.FINISHING, Phase.FAILED}),
    Phase.RECOVERING: frozenset({Phase.RESTORING, Phase.PAUSED, Phase.FAILED}),
    Phase.PAUSED: frozenset({Phase.RESTORING, Phase.FAILED}),
    Phase.FINISHING: frozenset({Phase.COMPLETED, Phase.FAILED}),
    Phase.COMPLETED: frozenset(),
    Phase.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A bug in the workflow: a phase change the table does not allow."""


def next_phase(current: Phase, new: Phase) -> Phase:
    if new not in ALLOWED_TRANSITIONS[current]:
        raise IllegalTransition(f"phase {current.value} cannot move to {new.value}")
    return new


# ------------------------------------------------------------------------------------------- decisions

NODE_FAULTS = frozenset({IncidentKind.NODE_UNRESPONSIVE, IncidentKind.GPU_UNHEALTHY,
                         IncidentKind.SILENT_DATA_CORRUPTION})

STRAGGLER_REPLACE_EVERY_S = 6 * 3600.0
"""A run replaces at most one straggler's node per this long, and at most as many as its own nodes over its life.
A straggler is judged from the compute each rank reports of itself (`compute_s`), which a script can make up or
make true on purpose (a sleep on one rank): unbounded, it spent a spare every few windows. Slow hardware is rare
and stays slow, so one replacement fixes it; the bound keeps what a script can do to one spare per 6 h."""
RANK_FAULTS = frozenset({IncidentKind.CRASH, IncidentKind.HANG, IncidentKind.CHECKPOINT_CORRUPT})


@dataclass(frozen=True, slots=True)
class RecoveryBudget:
    """What the run has spent on recovery so far."""

    restart_times: tuple[float, ...] = ()
    """Workflow-clock times (unix seconds) of earlier relaunches."""
    restarts_without_checkpoint: int = 0
    """Relaunches since the last newly committed checkpoint."""
    same_failure_attempts: int = 0
    """Consecutive attempts, this one included, whose crash had the incident's signature (`same_failure_streak`)."""
    straggler_replaced_at: tuple[float, ...] = ()
    """Workflow-clock times (unix seconds) of the run's earlier straggler replacements (`STRAGGLER_REPLACE_EVERY_S`)."""
    numerical_recurs: bool = False
    """The incident is a numerical fault at the step the previous attempt's was, after rolling back before it."""


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    replacement: str | None = None
    """The spare taking the failed node's place (REPLACE_NODE)."""
    cordon: bool = True
    """REPLACE_NODE, SHRINK: the node leaving is cordoned in the pool, for every run (a node fault the agent saw).
    False for a straggler: its slowness is what the run's own ranks report, which must not take a node from
    other runs; it leaves this run only and goes back to the pool."""
    hold: bool = False
    """REPLACE_NODE without `cordon`: the node leaving stays the run's, as a spare (a tie's suspect, which may be
    the healthy one)."""


def same_failure_streak(incident: Incident, earlier: Sequence[Incident]) -> int:
    """How many consecutive attempts, ending with `incident`'s, crashed with `incident`'s signature: 0 when
    it has none (a signal, a hang, a node fault). Incidents the run only reported (stragglers) ended no
    attempt and are skipped; any other incident in between breaks the streak."""
    if incident.kind is not IncidentKind.CRASH or incident.signature is None:
        return 0
    streak, expected = 1, incident.attempt - 1
    for before in reversed(earlier):
        if before.action is Action.REPORT or before.attempt > expected:
            continue
        if (before.attempt != expected or before.kind is not IncidentKind.CRASH
                or before.signature != incident.signature):
            break
        streak, expected = streak + 1, expected - 1
    return streak


def numerical_fault_recurs(incident: Incident, earlier: Sequence[Incident]) -> bool:
    """A numerical fault at the same step as the one that ended the previous attempt: the rollback replayed the
    same steps from the same checkpoint and met it again (incidents only reported in between are skipped)."""
    if incident.kind is not IncidentKind.NUMERICAL_FAULT or incident.bad_step is None:
        return False
    before = next((i for i in reversed(earlier) if i.action is not Action.REPORT and i.attempt < incident.attempt),
                  None)
    return (before is not None and before.kind is IncidentKind.NUMERICAL_FAULT
            and before.attempt == incident.attempt - 1 and before.bad_step == incident.bad_step)


def straggler_replaced_at(incidents: Sequence[Incident]) -> tuple[float, ...]:
    """When the run replaced a straggler's node, from its incidents (carried across continue-as-new)."""
    return tuple(i.detected_at for i in incidents
                 if i.kind is IncidentKind.STRAGGLER and i.action is Action.REPLACE_NODE)


def classify_exit(exit_code: int | None) -> IncidentKind:
    """A rank that exits with `EXIT_NO_RETRY` reports an error a restart cannot fix."""
    return IncidentKind.USER_ERROR if exit_code == EXIT_NO_RETRY else IncidentKind.CRASH


def may_change_world_size(newest: CheckpointRef | None) -> bool:
    """Whether the run may shrink or grow: not when its newest checkpoint loads only onto the world size that
    wrote it (a per-rank `torch.save` of DTensors). No checkpoint yet: the next attempt starts fresh."""
    return newest is None or newest.reshardable


def _not_reshardable(kind: IncidentKind, node: str, newest: CheckpointRef, new_world_size: int) -> Decision:
    return Decision(Action.PAUSE, (
        f"{kind.value} on {node} and no spare node left; not shrinking: the newest checkpoint (step {newest.step}) "
        f"is a per-rank torch.save of sharded tensors (DTensor) written by {newest.world_size} ranks, which "
        f"cannot be resharded onto {new_world_size}. Paused for an operator: fix the node or free a spare and "
        f"`resume`, or `abort`. To let the run shrink, save sharded state with DCP "
        f"(tg.init(checkpoint_format=\"auto\") or \"dcp\")"))


def _straggler(node: str | None, spec: RunSpec, active_nodes: list[str], spares: list[str], budget: RecoveryBudget,
               now: float, persisted: bool) -> Decision:
    """A persisted straggler's node leaves the run for a spare, uncordoned, within `STRAGGLER_REPLACE_EVERY_S`
    and the run's own node count; otherwise it is reported and training goes on."""
    if not (persisted and node in active_nodes and spares):
        return Decision(Action.REPORT, "straggler reported; training goes on")
    done = budget.straggler_replaced_at
    if len(done) >= len(spec.nodes):
        return Decision(Action.REPORT, f"straggler on {node} persisted; not replaced: the run replaced {len(done)} "
                                       f"stragglers already, as many as its nodes; training goes on")
    last = max(done, default=None)
    if last is not None and now - last < STRAGGLER_REPLACE_EVERY_S:
        return Decision(Action.REPORT, f"straggler on {node} persisted; not replaced: the run replaced one "
                                       f"{(now - last) / 60:.0f} min ago and replaces at most one every "
                                       f"{STRAGGLER_REPLACE_EVERY_S / 3600:.0f} h; training goes on")
    return Decision(Action.REPLACE_NODE, f"straggler on {node} persisted: replaced by spare {spares[0]}; {node} left "
                                         f"to the pool uncordoned (only the run's own ranks say it is slow)",
                    replacement=spares[0], cordon=False)


def decide(
    kind: IncidentKind,
    node: str | None,
    spec: RunSpec,
    active_nodes: list[str],
    spares: list[str],
    budget: RecoveryBudget,
    now: float,
    persisted: bool = False,
    newest: CheckpointRef | None = None,
    suspect: bool = False,
) -> Decision:
    """The remediation ladder: restart in place; replace a bad node with a spare; shrink to the spec's
    `min_nodes` when it allows and the checkpoint can be resharded; otherwise pause for an operator. Stop when
    the budget is spent or the script says a restart cannot help.

    `persisted` is for stragglers: true once one has lasted `health.straggler_windows` intervals. `newest` is
    the run's newest committed checkpoint, the one the next attempt restores. `suspect`: a silent data
    corruption that came back on the same two replicas' nodes (`workflows.supervision.tie_verdict`), `node` the
    one of them to set aside, uncordoned, for a spare: which one is sick shows in the attempts after.
    """
    if kind is IncidentKind.USER_ERROR:
        return Decision(Action.STOP, f"a rank exited with code {EXIT_NO_RETRY} (do not retry): fix the script")
    if (kind is IncidentKind.CRASH and spec.restarts.max_same_failure
            and budget.same_failure_attempts >= spec.restarts.max_same_failure):
        return Decision(Action.STOP, f"the same failure on {budget.same_failure_attempts} attempts in a row: "
                                     f"a relaunch will not fix it, fix the script "
                                     f"(restarts.max_same_failure={spec.restarts.max_same_failure})")
    if kind is IncidentKind.NUMERICAL_FAULT and budget.numerical_recurs:
        return Decision(Action.STOP, "the numerical fault came back at the same step after a rollback to the "
                                     "checkpoint before it, so no flipped bit or sick GPU caused it: it is the data "
                                     "or the hyper-parameters (learning rate, warm-up, loss scale). Fix them and "
                                     "resume from that checkpoint (checkpoint.resume_from)")
    if kind is IncidentKind.STORAGE_UNAVAILABLE:
        return Decision(Action.PAUSE, "checkpoint store unreachable at restore: paused for an operator "
                                      "(`resume` once the store is back, or `abort`)")
    if kind is IncidentKind.STRAGGLER:
        return _straggler(node, spec, active_nodes, spares, budget, now, persisted)
    recent = [t for t in budget.restart_times if now - t < spec.restarts.window_s]
    if len(recent) >= spec.restarts.max_restarts:
        return Decision(
            Action.STOP,
            f"restart budget spent: {len(recent)} restarts within {spec.restarts.window_s:.0f}s "
            f"(restarts.max_restarts={spec.restarts.max_restarts})",
        )
    if budget.restarts_without_checkpoint >= spec.restarts.max_restarts_without_checkpoint:
        return Decision(
            Action.STOP,
            f"{budget.restarts_without_checkpoint} restarts in a row committed no new checkpoint "
            f"(restarts.max_restarts_without_checkpoint={spec.restarts.max_restarts_without_checkpoint})",
        )
    if suspect and node in active_nodes:
        if spares:
            return Decision(Action.REPLACE_NODE, f"{kind.value} again on the same two nodes: {node} set aside for "
                                                 f"spare {spares[0]}, uncordoned, to tell which one is sick",
                            replacement=spares[0], cordon=False, hold=True)
        return Decision(Action.RESTART, f"{kind.value} again on the same two nodes and no spare to tell them "
                                        f"apart: relaunch from the checkpoint before it")
    if kind in NODE_FAULTS:
        if node is None or node not in active_nodes:
            return Decision(Action.RESTART, f"{kind.value} on a node no longer in the run: relaunch")
        if spares:
            return Decision(Action.REPLACE_NODE, f"{kind.value} on {node}: replaced by spare {spares[0]}",
                            replacement=spares[0])
        if spec.min_nodes is not None and len(active_nodes) - 1 >= spec.min_nodes:
            if newest is not None and not may_change_world_size(newest):
                return _not_reshardable(kind, node, newest, (len(active_nodes) - 1) * spec.ranks_per_node)
            return Decision(Action.SHRINK, f"{kind.value} on {node} and no spare node left: continue on "
                                           f"{len(active_nodes) - 1} nodes (min_nodes={spec.min_nodes})")
        return Decision(Action.PAUSE, f"{kind.value} on {node} and no spare node left: paused for an operator "
                                      f"(fix the node and `resume`, or `abort`)")
    return Decision(Action.RESTART, f"{kind.value}: relaunch every rank from the newest committed checkpoint")
