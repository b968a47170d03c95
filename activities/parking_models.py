"""What a run asks of a spare's agent to make the spare's relaunch warm (`RankLaunch.park_ranks`, the logic in
`activities.rank_parking`): plain models, so the run's workflows can import them."""

from __future__ import annotations

from pydantic import BaseModel

from activities.models import LaunchRanksInput


class ParkRanksInput(BaseModel):
    """Park the run's processes on a spare node the run holds, ahead of the launch that will take them."""

    workflow_id: str
    node: str
    """The spare node asked (its agent's task queue)."""
    launch: LaunchRanksInput
    """The launch template of the run's attempt (entrypoint, env, working_dir, chain_id, ranks_per_node): the
    agent parks what a later launch on this node will ask for, keyed alike (`park_key`), so the launch takes them.
    Its node, node rank and rendezvous fields are placeholders: a spare has none of its own yet."""


class ParkRanksResult(BaseModel):
    parked: int = 0
    """Processes parked for the run on the node now (0: it runs the run's ranks itself, or cannot park)."""
    already: bool = False
    """The node had them parked already (a retried or repeated request): nothing was started."""
