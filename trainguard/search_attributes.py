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


async def ensure_registered(client) -> bool:  # type: ignore[no-untyped-def]
    """Register the attributes in the client's namespace if missing; False when not allowed (e.g. on a
    Temporal Cloud namespace without admin rights: register them there with tcld or the UI)."""
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest

    kinds = {"keyword": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD, "int": IndexedValueType.INDEXED_VALUE_TYPE_INT}
    try:
        existing = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=client.namespace)
        )
        missing = {key.name: kinds["keyword" if key is PHASE else "int"]
                   for key in ALL if key.name not in existing.custom_attributes}
        if missing:
            await client.operator_service.add_search_attributes(
                AddSearchAttributesRequest(namespace=client.namespace, search_attributes=missing)
            )
        return True
    except Exception as error:  # noqa: BLE001 - registration is a convenience, never fatal
        log.warning("could not register search attributes %s: %s", [k.name for k in ALL], error)
        return False


async def registered(client) -> bool:  # type: ignore[no-untyped-def]
    """Whether every attribute is registered, so a workflow may upsert them without failing its tasks."""
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

    try:
        existing = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=client.namespace)
        )
    except Exception:  # noqa: BLE001
        return False
    return all(key.name in existing.custom_attributes for key in ALL)
