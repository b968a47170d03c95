"""OpenTelemetry tracing through Temporal's interceptor, when switched on.

Set `OTEL_EXPORTER_OTLP_ENDPOINT` (the standard variable, e.g. `http://otel-collector:4318`) or
`TRAINGUARD_TRACING=1` in the environment of the workers, the CLI and the client, and install the `otel`
extra (`pip install 'trainguard[otel]'`). Every process then exports spans over OTLP/HTTP: starting a run
(client or CLI), each workflow task of the run, every activity (launch, watch, upload, commit, ...) on the
controller and on the node agents, all in one trace per run. The standard `OTEL_*` variables configure the
exporter (headers, timeout) and `OTEL_SERVICE_NAME` names the process (default `trainguard`).

A process that already installed its own tracer provider (a user's pipeline) keeps it: trainguard only adds
the interceptor.
"""

from __future__ import annotations

import os
from typing import Any

from trainguard.settings import env_flag

_configured = False


def enabled(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")) or \
        env_flag("TRAINGUARD_TRACING", False, environ)


def interceptors(environ: dict[str, str] | os._Environ[str] = os.environ) -> list[Any]:
    """The client interceptors to connect with: Temporal's tracing interceptor when tracing is on (it also
    reaches the workers built on that client), else none."""
    if not enabled(environ):
        return []
    try:
        from opentelemetry import trace
        from temporalio.contrib.opentelemetry import TracingInterceptor
    except ImportError as error:
        raise RuntimeError(f"tracing is on (OTEL_EXPORTER_OTLP_ENDPOINT or TRAINGUARD_TRACING) but OpenTelemetry "
                           f"is not installed: pip install 'trainguard[otel]' ({error})") from None
    global _configured
    if not _configured and type(trace.get_tracer_provider()).__name__ in ("ProxyTracerProvider", "NoOpTracerProvider"):
        trace.set_tracer_provider(_otlp_provider(environ))
    _configured = True
    return [TracingInterceptor()]


def _otlp_provider(environ: dict[str, str] | os._Environ[str]) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as error:
        raise RuntimeError(f"tracing needs the OpenTelemetry SDK and OTLP exporter: pip install 'trainguard[otel]' "
                           f"({error})") from None
    provider = TracerProvider(resource=Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME",
                                                                                     "trainguard")}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider
