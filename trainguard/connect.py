"""One way to reach Temporal for workers, the CLI and the client: pydantic payloads, settings from env."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from trainguard import tracing
from trainguard.codec import data_converter_from_env
from trainguard.settings import Settings


async def connect(settings: Settings | None = None) -> Client:
    """A client with pydantic payloads; with `TRAINGUARD_METRICS_ADDRESS` set, this process serves the SDK's
    and trainguard's Prometheus metrics there (workers set it; one address per process)."""
    settings = settings or Settings.from_env()
    runtime = None
    if settings.metrics_address:
        runtime = Runtime(telemetry=TelemetryConfig(
            metrics=PrometheusConfig(bind_address=settings.metrics_address, durations_as_seconds=True)))
    return await Client.connect(
        settings.temporal_address, namespace=settings.namespace, data_converter=data_converter_from_env(),
        runtime=runtime, tls=settings.tls_config(), api_key=settings.api_key,
        interceptors=tracing.interceptors(),
    )
