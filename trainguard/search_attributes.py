"""Custom search attributes, so runs can be filtered in the Web UI and with `temporal workflow list --query`:

    temporal workflow list --query "TrainguardPhase = 'paused'"
    temporal workflow list --query "TrainguardIncidents > 0"
"""

from __future__ import annotations

import logging

from temporalio.common import SearchAttributeKey

PHASE = SearchAttributeKey.for_keyword("TrainguardPhase")
"""The run's phase (`running`, `recovering`, `paused`, ...)."""
STEP = SearchAttributeKey.for_int("TrainguardStep")
"""Newest committed checkpoint step."""
INCIDENTS = SearchAttributeKey.for_int("TrainguardIncidents")
"""Incidents so far."""

ALL = (PHASE, STEP, INCIDENTS)

log = logging.getLogger(__name__)


async def _missing(client):
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

    existing = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace)
    )
    return [key for key in ALL if key.name not in existing.custom_attributes]


async def ensure_registered(client) -> bool:
    """Register the attributes in the client's namespace if missing; False when not allowed (e.g. on a
    Temporal Cloud namespace without admin rights: register them there with tcld or the UI)."""
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest

    try:
        missing = await _missing(client)
        if missing:
            # The SDK's indexed value types carry the server's enum numbers.
            await client.operator_service.add_search_attributes(AddSearchAttributesRequest(
                namespace=client.namespace,
                search_attributes={key.name: int(key.indexed_value_type)  # type: ignore[misc]  # a NewType of int
                                   for key in missing},
            ))
        return True
    except Exception as error:  # noqa: BLE001 - registration is a convenience, never fatal
        log.warning("could not register search attributes %s: %s", [k.name for k in ALL], error)
        return False


async def registered(client) -> bool:
    """Whether every attribute is registered, so a workflow may upsert them without failing its tasks."""
    try:
        return not await _missing(client)
    except Exception:  # noqa: BLE001 - an unreachable operator service means "don't upsert"
        return False
