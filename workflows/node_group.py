"""Watching thousands of nodes through child workflows: one `NodeGroupWatch` per `WATCH_NODES_PER_GROUP` nodes
(node calls go through `NodeCalls` children, workflows/node_calls.py).

Temporal allows 2,000 pending activities per execution and refuses a whole workflow task that would pass
it: a `TrainingRun` of 1,024 nodes that watched, uploaded and stopped every node itself hung at its first
crash. So a run never calls a node itself. Each per-node operation (check, download, launch, rejoin, stop,
checkpoint request) runs as a `NodeCalls` child per group, and each attempt's watching as a `NodeGroupWatch`
child per group, which keeps its watches alive and returns only what the run must decide on: an incident,
a lost node, or every node finished. The run's own history grows with groups and incidents, and each
group's history with its nodes and attempts, never with nodes x checkpoints (checkpoints do not pass
through either: agents upload their own shards, and the committer sees them in the store).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from activities import names
    # Passed through, not imported again in every workflow's sandbox: a 4,096-node relaunch starts hundreds of
    # node-group children, and defining their pydantic models anew in each cost seconds of controller CPU.
    from activities.models import (CheckNodeInput, CheckNodeResult, CollectEvidenceInput, CollectEvidenceResult,
                                   WatchEvent, WatchEventKind)
    from trainguard import NODE_GROUP_WATCH_WORKFLOW, node_task_queue
    from trainguard.models import short_cause
    from trainguard.protocol import WatchHeartbeat
    from workflows.node_calls import (BURST_SCHEDULE_TO_START, EVIDENCE_RETRY, EVIDENCE_TIMEOUT,
                                      NODE_SCHEDULE_TO_START, SANDBOXED, TRANSFER_TIMEOUT, node_failure, not_started)
    from workflows.node_group_models import (GroupReport, GroupStarted, LostNode, NodeGroupWatchInput,
                                             NodeGroupWatchResult, UploadTrouble)


WATCH_NODES_PER_GROUP = 16
"""Nodes per `NodeGroupWatch`, smaller than a call group: every start and heartbeat of a watch is a write of its
group's execution, which Temporal serializes (one lock per execution) and sheds past its rate ("busy workflow",
an activity start retried). A relaunch starts all of a group's launching watches at once: at 64 a group, a
4,096-node relaunch had its watch starts refused 12,596 times on the dev server (`RecordActivityTaskStarted`,
BusyWorkflow), so its last nodes launched late and live nodes' heartbeats went unrecorded for a minute. At 16
the same burst is spread over 256 executions (a 4,096-node run: 256 children, its pending count still far inside
the limit; a relaunch costs the run's history about 8 events per group)."""

GROUP_HISTORY_EVENTS = 10_000
"""A group watching for days continues as new past this (keepalives add 6 events per node per
`WATCH_MAX_DURATION_S`: a day for 64 nodes), at a keepalive: its ranks keep running, its watches start again."""

# ------------------------------------------------------------------------------ timeouts and retries



LAUNCH_BURST_STARTS_PER_S = 100
"""Activity starts a second a run's launching burst is allowed, at the least, before a node that has not started
its launching watch is taken as lost: a burst of N waits max(`BURST_SCHEDULE_TO_START`, N / 100 s)
(`launch_wait_s`). Matching thousands of activities to their agents takes time in proportion on any Temporal
(a Temporal Cloud namespace admits a few hundred to a few thousand actions a second): at 4,096 nodes here the
last of a first launch's watches was matched 25 s after it was scheduled."""


def launch_wait_s(num_nodes: int) -> float:
    """How long a launching watch of a run of `num_nodes` nodes may wait to be matched (past one group)."""
    return max(BURST_SCHEDULE_TO_START.total_seconds(), num_nodes / LAUNCH_BURST_STARTS_PER_S)





WATCH_MAX_DURATION_S = 3600.0
"""A watch returns after this long even if nothing happened, so no activity runs unbounded. Each renewal costs
about 6 events and an action per node: an hour, not minutes, keeps a 2,048-node run's renewals near 50,000
a day (a dead agent is noticed by the heartbeat timeout, whatever this is)."""

WATCH_TIMEOUT = timedelta(seconds=WATCH_MAX_DURATION_S + 60)
WATCH_HEARTBEAT_TIMEOUT = timedelta(seconds=10)
"""The agent heartbeats every poll (0.2 s by default): 10 s of silence means the node is unresponsive. A run
of more than `HEARTBEATS_PER_S` nodes waits longer (`watch_heartbeat_timeout`)."""

HEARTBEATS_PER_S = 200
"""Watch heartbeats one run sends Temporal each second, at most. Every node's watch heartbeats (an RPC and a
write of the activity's state on the server, never an event), so at one a second each a 4,096-node run sent
4,096 a second, and on this machine's dev server that load made live nodes' heartbeats late (read as lost) and
launching watches wait past their bound. Past 200 nodes each node's watch heartbeats every nodes / 200 s
(4,096 nodes: every 20 s) and is given 3 times that before its node is taken as lost (61 s), so the server's
load is bounded per run; a lost node of a large run is noticed that much later (its peers' ranks, blocked in
their next collective, are usually judged hung sooner)."""

HEARTBEAT_TIMEOUT_INTERVALS = 3
"""A watch's heartbeat timeout is at least this many of its heartbeat intervals: one late heartbeat is load,
three in a row a lost node."""


def watch_heartbeat_every_s(num_nodes: int) -> float | None:
    """How often each node's watch heartbeats so the run sends at most `HEARTBEATS_PER_S`; None up to that
    many nodes (every poll, as the agent's `TRAINGUARD_HEARTBEAT_INTERVAL_S` throttles it)."""
    return None if num_nodes <= HEARTBEATS_PER_S else round(num_nodes / HEARTBEATS_PER_S, 3)


def watch_heartbeat_timeout(heartbeat_every_s: float | None) -> timedelta:
    """The heartbeat timeout of a watch that heartbeats every `heartbeat_every_s` (None: every poll)."""
    if heartbeat_every_s is None:
        return WATCH_HEARTBEAT_TIMEOUT
    return max(WATCH_HEARTBEAT_TIMEOUT, timedelta(seconds=HEARTBEAT_TIMEOUT_INTERVALS * heartbeat_every_s))

SILENT_CHECK_SCHEDULE_TO_START = timedelta(seconds=10)
"""A watch whose heartbeats stopped: its node is asked (`check_node`) whether its agent is there before it is
taken as lost. The Temporal server restarting loses the heartbeats of every live agent (a restart longer than
the heartbeat timeout times out every watch at once as it comes back), and an agent killed and started again
adopts its ranks; either way an agent polls the node's queue within seconds (a restarted server: its worker
polls again; a new agent: it registers). A node that is really gone is found that much later."""
SILENT_CHECK_TIMEOUT = timedelta(seconds=5)
SILENT_CHECK_RETRY = RetryPolicy(maximum_attempts=1)
"""The check is the question; a retry would only delay the answer."""
MAX_SILENT_REWATCHES = 3
"""Watches started again on one node because its agent answered after going silent, per group run: an agent
that keeps answering while its watches keep timing out has a broken watch, and its node is lost after all."""



PEER_EVIDENCE_WAIT = timedelta(seconds=2)
"""After a node's watch reports a hang with its ranks' evidence, how long the group waits for its other nodes'
evidence, asked at once (`collect_evidence`: half a second at most on a live node). Their ranks wait in the
collective the hung rank never joined, which is a wait, not a hang (`activities.progress.judge_rank`), so none of
them reports one; the group asks instead of waiting for reports that do not come (waiting cost every hang's
relaunch 0.5 s, plus the run's asking after it). A node that has not answered by then is asked by the run. Groups
that stand (runs past 64 nodes) ask no node: there the relaunch is published from the first report and the culprit
named from the evidence in hand (the culprit's own node reports it: its rank is the one judged hung)."""



WATCH_RETRY = RetryPolicy(maximum_attempts=1)
"""A failed watch is itself the signal (the agent died or froze): the workflow decides, not a retry."""









def _never_heartbeated(error: ActivityError) -> bool:
    """The activity timed out on its heartbeat without one heartbeat recorded. For a launching watch of a burst
    of thousands on a busy Temporal, that is how a watch whose start was recorded but never delivered to its
    agent ends: the server sheds a burst's starts on a busy execution ("busy workflow") and retries them, and
    a live node read as lost in 4,096-node relaunches here, a minute after its watch was marked started."""
    return (isinstance(error.cause, TimeoutError) and error.cause.type is TimeoutType.HEARTBEAT
            and not error.cause.last_heartbeat_details)


def _unheard(error: ActivityError) -> bool:
    """No agent ever reported on the activity: not started in time, or timed out before its first heartbeat.
    A launching watch so ended gets a large run's unasked second chance, and, asked, launches again."""
    return not_started(error) or _never_heartbeated(error)


def _heartbeat_timed_out(error: ActivityError) -> bool:
    """The activity timed out on its heartbeat: its agent (or the server) went silent, or, with no heartbeat
    recorded, its agent was killed or the server restarted before its first one came (a soak lost a live node
    of a starting run each way: an agent killed 1.4 s into the launch, back 6 s later; Temporal killed 0.6 s
    in). Either way only the node, asked, can say whether it is gone."""
    return isinstance(error.cause, TimeoutError) and error.cause.type is TimeoutType.HEARTBEAT


def _was_downloading(error: ActivityError) -> bool:
    """The watch's last heartbeat said it was downloading its launch's shards (it had not launched yet)."""
    details = error.cause.last_heartbeat_details if isinstance(error.cause, TimeoutError) else ()
    beat = WatchHeartbeat.from_json(details[0]) if details else None
    return beat is not None and beat.downloading









async def _tell_run(run_workflow_id: str, signal: str, message: GroupStarted | UploadTrouble) -> None:
    try:
        await workflow.get_external_workflow_handle(run_workflow_id).signal(signal, message)
    except Exception as error:  # noqa: BLE001 - the run closed meanwhile: nobody to tell
        workflow.logger.warning("could not signal %s to run %s: %s", signal, run_workflow_id, error)


@workflow.defn(name=NODE_GROUP_WATCH_WORKFLOW, sandboxed=SANDBOXED)
class NodeGroupWatch:
    """Watch a group's nodes for one attempt; return on the first incident or lost node, or once every node
    has finished. Keepalives restart a watch here, and the group tells its run once when all its nodes have
    run the attempt's first step. A standing group (`NodeGroupWatchInput.standing`) reports instead of
    returning, and watches the run's next attempts too."""

    def __init__(self) -> None:
        self._next: NodeGroupWatchInput | None = None
        self._signals: list[asyncio.Task[None]] = []

    @workflow.signal
    def next_attempt(self, request: NodeGroupWatchInput) -> None:
        """A standing group's next attempt: the spares that join it (and any node left without a watch) launch
        from a new watch; the others take it up in place, those that reported from the watch they wait in."""
        if self._next is None or request.watch.attempt >= self._next.watch.attempt:
            self._next = request

    @workflow.run
    async def run(self, request: NodeGroupWatchInput) -> NodeGroupWatchResult:
        started = dict(request.started)
        parks = False  # a starter's ranks of the attempt called `standby()`: the run may park on its spares
        started_attempt = request.watch.attempt
        finished = {e.node: e for e in request.finished}
        signalled = request.signalled
        starters = request.nodes if request.starters is None else [n for n in request.nodes if n in request.starters]
        watches = {n: self._watch(request, n, report_start=n in starters and n not in started, launch=True)
                   for n in request.nodes if n not in finished}
        # Nodes whose current watch is their launching one: none has come back yet.
        launching = set(watches) if request.launch is not None else set()
        retried: set[str] = set()
        rewatched: dict[str, int] = {}
        told = asyncio.ensure_future(workflow.wait_condition(lambda: self._next is not None)) if request.standing \
            else None
        # Watches still running when the group closes are left, not cancelled: a cancel that races a watch
        # just returned is refused (ACTIVITY_UNKNOWN) and fails the workflow task. Once the group has closed,
        # each watch's next heartbeat (a second) is refused and its agent stops it; the ranks keep running,
        # as they would for a cancelled watch.
        while True:
            if told is not None and told.done():
                assert self._next is not None
                told_of, self._next = self._next, None
                told = asyncio.ensure_future(workflow.wait_condition(lambda: self._next is not None))
                idle = [n for n in told_of.nodes if n not in watches and n not in finished]
                if told_of.watch.attempt <= request.watch.attempt and told_of.nodes == request.nodes and not idle:
                    continue  # nothing new (a report the run took for a previous history's, say)
                if told_of.watch.attempt > request.watch.attempt:
                    started, started_attempt, signalled, finished = {}, told_of.watch.attempt, False, {}
                    parks = False
                request = told_of.model_copy(update={"standing": True})
                starters = [n for n in request.nodes if request.starters is None or n in request.starters]
                watches = {n: t for n, t in watches.items() if n in request.nodes}
                for node in request.nodes:  # a spare joining, or a node without a watch: it launches from a new one
                    if node not in watches and node not in finished:
                        watches[node] = self._watch(request, node, report_start=node in starters
                                                    and node not in started, launch=True)
                        launching.add(node)
                retried = set()
            if watches or told is not None:
                await workflow.wait([*watches.values(), *([told] if told is not None else [])],
                                    return_when=asyncio.FIRST_COMPLETED)
            result = NodeGroupWatchResult()
            keepalive = False
            # A launching watch of a large run that never heartbeated is scheduled once more without asking.
            second_chance = {n for n in launching if request.launch_second_chance and n not in retried}
            answered = await self._silent_but_there(request.nodes, watches, second_chance, rewatched)
            for node in request.nodes:  # a fixed order keeps the workflow deterministic
                task = watches.get(node)
                if task is None or not task.done():
                    continue
                del watches[node]
                try:
                    event = task.result()
                except ActivityError as error:
                    if node in launching and request.launch_second_chance and node not in retried and _unheard(error):
                        retried.add(node)  # once: a second miss is asked (`_silent_but_there`)
                        workflow.logger.warning("%s did not start its launching watch in time, or never heartbeated "
                                                "in it: scheduled again", node)
                        watches[node] = self._watch(request, node, report_start=node in starters
                                                    and node not in started, launch=True)
                        continue
                    if node in answered:  # the server or the agent restarted: not a lost node
                        rewatched[node] = rewatched.get(node, 0) + 1
                        # A launching watch silent while it downloaded, before its first heartbeat, or never
                        # started, launches again (a launch adopts ranks of its attempt already running); one that
                        # heartbeated past that had launched.
                        launch = node in launching and (_was_downloading(error) or _unheard(error))
                        if not launch:
                            launching.discard(node)
                        workflow.logger.warning("%s's watch %s but its agent answers: watched again", node,
                                                "was not started in time" if not_started(error)
                                                else "stopped heartbeating")
                        watches[node] = self._watch(request, node, report_start=node in starters
                                                    and node not in started, launch=launch)
                        continue
                    how = "stopped heartbeating" if isinstance(error.cause, TimeoutError) else "failed"
                    failure = node_failure(node, error)
                    result.lost.append(LostNode(node=node, detail=f"node agent {how}: {short_cause(failure.error)}",  # type: ignore[arg-type]  # _failure always sets error
                                                error_type=failure.error_type, away_since=failure.away_since,
                                                never_started=node in launching and not_started(error)
                                                and node not in request.launched))
                    launching.discard(node)
                    continue
                launching.discard(node)
                of = event.attempt or request.watch.attempt
                if of > started_attempt:  # a standing group's node took up a newer attempt in place
                    started, started_attempt, signalled, parks = {}, of, False, False
                if event.kind is WatchEventKind.STARTED:
                    started[node] = event.first_step_at or event.detected_at
                    parks = parks or event.standby
                    watches[node] = self._watch(request, node, report_start=False)
                elif event.kind is WatchEventKind.KEEPALIVE:
                    keepalive = True
                    watches[node] = self._watch(request, node, report_start=node in starters and node not in started)
                    if event.upload_error:  # the run's status names it; not awaited, as `_tell_started`
                        self._signals.append(asyncio.ensure_future(_tell_run(
                            request.run_workflow_id, "upload_trouble",
                            UploadTrouble(node=node, error=event.upload_error, at=event.detected_at))))
                elif event.kind is WatchEventKind.FINISHED:
                    finished[node] = event
                    if event.first_step_at is not None:
                        started.setdefault(node, event.first_step_at)
                elif request.standing and of < request.watch.attempt and request.launch is not None:
                    # Its ranks of an attempt the run has left failed before it took up the next: it launches
                    # the next from a new watch, as the nodes reported do.
                    watches[node] = self._watch(request, node, report_start=node in starters, launch=True)
                    launching.add(node)
                    if event.evidence or event.kind is WatchEventKind.GPU_UNHEALTHY:
                        # ...and the run still hears of it: a hang relaunched before every node's evidence was
                        # in names its culprit from it, and a sick GPU is not trained on.
                        result.incidents.append(event)
                else:
                    result.incidents.append(event)
            waiting = [n for n in starters if n not in started and n not in finished]
            if not signalled and started and not waiting:
                signalled = True
                # Not awaited: a cancel of the group that arrives while its signal is in flight would be
                # swallowed if the signal then succeeds (the SDK resolves the signal, not the cancel), and the
                # group would watch on while its run waits for it to close.
                self._signals.append(asyncio.ensure_future(_tell_run(
                    request.run_workflow_id, "group_started", GroupStarted(
                    attempt=started_attempt, group=request.group, first_step_at=min(started.values()),
                    parks=parks))))
            if result.incidents or result.lost:
                if (request.watch.evidence_with_event and watches and not result.lost and not request.standing
                        and any(e.kind is WatchEventKind.HANG for e in result.incidents)):
                    await self._peers_evidence(request, watches, result)
                if not request.standing:
                    return result
                for event in result.incidents:  # each waits in a watch to take up the next attempt in place
                    if event.node not in watches:
                        watches[event.node] = self._watch(request, event.node, report_start=False,
                                                          after=event.attempt or request.watch.attempt)
                await workflow.get_external_workflow_handle(request.run_workflow_id).signal(
                    "group_report", GroupReport(group=request.group, attempt=request.watch.attempt, result=result))
                continue
            if len(finished) == len(request.nodes):
                if told is not None:
                    told.cancel()
                return NodeGroupWatchResult(finished=[finished[n] for n in request.nodes])
            info = workflow.info()
            if keepalive and self._next is None and len(watches) + len(finished) == len(request.nodes) and (
                    info.is_continue_as_new_suggested() or info.get_current_history_length() > GROUP_HISTORY_EVENTS):
                workflow.continue_as_new(request.model_copy(update={
                    "started": started, "finished": list(finished.values()), "signalled": signalled,
                    "launch": None, "download": None}))  # every node has launched: a watch returned

    @staticmethod
    async def _peers_evidence(request: NodeGroupWatchInput, watches: dict[str, asyncio.Task[WatchEvent]],
                              result: NodeGroupWatchResult) -> None:
        """The evidence of the group's nodes still watching (`PEER_EVIDENCE_WAIT`), in `result.evidence`; the
        failures those nodes reported meanwhile added to `result.incidents`."""
        hung = next(e for e in result.incidents if e.kind is WatchEventKind.HANG)
        attempt = hung.attempt or request.watch.attempt
        target = request.watch.checkpoints
        asks = {node: asyncio.ensure_future(workflow.execute_activity(
            names.COLLECT_EVIDENCE,
            CollectEvidenceInput(workflow_id=request.watch.workflow_id, attempt=attempt, node=node,
                                 bucket=target.bucket if target else None,
                                 run_prefix=target.run_prefix if target else ""),
            task_queue=node_task_queue(node), start_to_close_timeout=EVIDENCE_TIMEOUT,
            schedule_to_start_timeout=PEER_EVIDENCE_WAIT, retry_policy=EVIDENCE_RETRY,
            result_type=CollectEvidenceResult, summary=f"collect hang evidence on {node} (attempt {attempt})"))
            for node in request.nodes if node in watches and not watches[node].done()}  # a fixed order
        if asks:
            await workflow.wait(list(asks.values()), timeout=PEER_EVIDENCE_WAIT.total_seconds())
        for node, ask in asks.items():
            if not ask.done():
                ask.cancel()
            elif ask.exception() is None and ask.result().ranks:  # none: its report may still bring some
                result.evidence[node] = ask.result().ranks
        for node in request.nodes:
            task = watches.get(node)
            if task is None or not task.done() or task.exception() is not None:
                continue  # a node lost meanwhile: its stop tells the run, as for any watch left behind
            event = task.result()
            if event.kind in (WatchEventKind.HANG, WatchEventKind.RANK_EXITED, WatchEventKind.GPU_UNHEALTHY):
                result.incidents.append(event)

    async def _silent_but_there(self, nodes: list[str], watches: dict[str, asyncio.Task[WatchEvent]],
                                second_chance: set[str], rewatched: dict[str, int]) -> set[str]:
        """The nodes whose watch timed out on its heartbeat, or waiting for its agent to start it, but whose agent
        answers a check, asked together (not those whose launching watch gets its `second_chance` unasked). An
        agent killed as its run launched and back 13 s later (a loaded machine) had left its launching watch
        unstarted past `NODE_SCHEDULE_TO_START`, and the restart matrix's run took the live node as lost."""
        silent = [n for n in nodes if n in watches and watches[n].done() and rewatched.get(n, 0) < MAX_SILENT_REWATCHES
                  and isinstance(error := watches[n].exception(), ActivityError)
                  and (_heartbeat_timed_out(error) or not_started(error))
                  and not (n in second_chance and _unheard(error))]
        if not silent:
            return set()
        answers = await asyncio.gather(*(self._answers(n) for n in silent))
        return {n for n, there in zip(silent, answers) if there}

    @staticmethod
    async def _answers(node: str) -> bool:
        """Whether `node`'s agent takes up a check within `SILENT_CHECK_SCHEDULE_TO_START`: only a check no agent
        started says the node is gone (one that failed or ran long was taken up by a live agent)."""
        try:
            await workflow.execute_activity(
                names.CHECK_NODE, CheckNodeInput(workflow_id=workflow.info().workflow_id, node=node),
                task_queue=node_task_queue(node), schedule_to_start_timeout=SILENT_CHECK_SCHEDULE_TO_START,
                start_to_close_timeout=SILENT_CHECK_TIMEOUT, retry_policy=SILENT_CHECK_RETRY,
                result_type=CheckNodeResult, summary=f"is {node} there? (its watch went silent)")
        except ActivityError as error:
            return not not_started(error)
        return True

    @staticmethod
    def _watch(request: NodeGroupWatchInput, node: str, report_start: bool,
               launch: bool = False, after: int | None = None) -> asyncio.Task[WatchEvent]:
        """`node`'s watch; its first (`launch`) also launches the node's ranks when the group launches them;
        `after`: one that reports nothing of that attempt (`WatchRanksInput.after_attempt`)."""
        update: dict[str, object] = {"node": node, "report_start": report_start, "after_attempt": after}
        launches = launch and request.launch is not None and node not in request.launched
        if launches:
            assert request.launch is not None
            node_rank = request.first_node_rank + request.nodes.index(node)
            update["launch"] = request.launch.model_copy(update={"node": node, "node_rank": node_rank})
            if request.download is not None:
                per_node = request.launch.ranks_per_node
                update["download"] = request.download.model_copy(update={
                    "node": node, "ranks": list(range(node_rank * per_node, (node_rank + 1) * per_node))})
                update["download_timeout_s"] = TRANSFER_TIMEOUT.total_seconds()
        watch = request.watch.model_copy(update=update)
        return asyncio.ensure_future(workflow.execute_activity(
            names.WATCH_RANKS, watch,
            task_queue=node_task_queue(node),
            # A launching watch may first download for as long as a download activity would.
            start_to_close_timeout=WATCH_TIMEOUT + TRANSFER_TIMEOUT if launches else WATCH_TIMEOUT,
            schedule_to_start_timeout=(BURST_SCHEDULE_TO_START if request.launch_wait_s is None
                                       else timedelta(seconds=request.launch_wait_s)) if launches
            else NODE_SCHEDULE_TO_START,
            heartbeat_timeout=watch_heartbeat_timeout(watch.heartbeat_every_s),
            retry_policy=WATCH_RETRY,
            result_type=WatchEvent,
            summary=f"watch ranks on {node} (attempt {watch.attempt})",
        ))
