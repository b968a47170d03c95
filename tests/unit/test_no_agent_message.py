"""A run whose nodes have no agent fails saying where agents come from when the controller knows (a dev stack in
Slurm mode starts none: Slurm jobs do), not only `no node agent polls ... (unknown node)`."""

from __future__ import annotations

from typing import Any

from temporalio import activity
from temporalio.testing import WorkflowEnvironment
from test_training_run_workflow import Cluster, _failure_message, _node_ids, _run, _spec

from activities.models import FindNodeAgentsInput, FindNodeAgentsResult

HINT = "the dev stack is in Slurm mode: run sbatch"


class SlurmModeCluster(Cluster):
    """Its controller's `find_node_agents` gives the hint a dev stack in Slurm mode gives."""

    def controller_activities(self) -> list[Any]:
        @activity.defn(name="find_node_agents")
        async def find_node_agents(request: FindNodeAgentsInput) -> FindNodeAgentsResult:
            missing = [n for n in request.nodes if n in self.missing]
            return FindNodeAgentsResult(missing=missing, no_agent_hint=HINT if missing else None)

        return [find_node_agents, *(a for a in super().controller_activities()
                                    if getattr(a, "__temporal_activity_definition").name != "find_node_agents")]


async def test_a_run_on_nodes_without_agents_says_where_agents_come_from(env: WorkflowEnvironment) -> None:
    nodes = _node_ids(2)
    cluster = SlurmModeCluster(nodes=nodes, missing=list(nodes))

    run = await _run(env, cluster, _spec(nodes))

    message = _failure_message(run.outcome)
    assert f"nodes.0 '{nodes[0]}', nodes.1 '{nodes[1]}': no node agent polls" in message
    assert message.endswith(f"(unknown node); {HINT}")
    assert cluster.inputs("launch_ranks") == []
