"""One way to reach Temporal for workers, the CLI and the client: pydantic payloads, settings from env."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from trainguard.settings import Settings


async def connect(settings: Settings | None = None) -> Client:
    settings = settings or Settings.from_env()
    return await Client.connect(
        settings.temporal_address, namespace=settings.namespace, data_converter=pydantic_data_converter
    )
