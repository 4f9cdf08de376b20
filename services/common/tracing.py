"""OpenTelemetry traces for every service: the flags, the SDK set-up (OTLP over gRPC, batched), span helpers that
cost nothing when tracing is off, W3C trace context in gRPC metadata (services.common.trace_grpc), and the trace id
in log lines.

    settings = TraceSettings(enable_trace=True, otlp_traces_endpoint="collector:4317")
    setup_tracing(settings, role="router")          # once, at start-up, before any channel or server is made
    with span("route", policy="cache_aware") as s:  # s is None when tracing is off
        ...
    record_span("queue", start_mono, end_mono)      # a span from time.monotonic() readings taken earlier

With tracing off (the default) nothing of OpenTelemetry is imported: `span` returns a shared null context, no
interceptor is installed and log lines are unchanged. With it on, the standard OTEL_* variables apply through the SDK
(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
OTEL_TRACES_SAMPLER[_ARG], OTEL_PROPAGATORS, OTEL_BSP_*); --otlp-traces-endpoint wins over the variables."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from services.common import logs

log = logging.getLogger(__name__)

SERVICE_PREFIX = "radixmesh-"  # service.name = radixmesh-<role> unless OTEL_SERVICE_NAME says otherwise
_NULL = contextlib.nullcontext()
_tracer = None  # the process's opentelemetry Tracer while tracing is on
_provider = None


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """The tracing flags every service takes (pass it to parse_settings as an extra class)."""

    enable_trace: bool = field(default=False, metadata={
        "help": "export OpenTelemetry traces over OTLP/gRPC (one trace per request across the services)"})
    otlp_traces_endpoint: str | None = field(default=None, metadata={
        "help": "host:port (or http[s]://host:port) of the OTLP/gRPC trace collector (default: "
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT, else localhost:4317); giving it "
                "turns tracing on"})

    @property
    def enabled(self) -> bool:
        return self.enable_trace or self.otlp_traces_endpoint is not None


def enabled() -> bool:
    return _tracer is not None


def setup_tracing(settings: TraceSettings, role: str) -> bool:
    """Install the SDK's TracerProvider (batched OTLP/gRPC export) for this process when tracing is on; returns
    whether it is. Call once, before channels and servers are created (they pick their interceptors then)."""
    global _tracer, _provider
    if not settings.enabled or _tracer is not None:
        return _tracer is not None
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"radixmesh.role": role}
    if "OTEL_SERVICE_NAME" not in os.environ and "service.name=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes["service.name"] = SERVICE_PREFIX + role
    endpoint = settings.otlp_traces_endpoint
    if endpoint is not None and "://" not in endpoint:
        endpoint = "http://" + endpoint  # a bare host:port is a plain-text collector, as SGLang's default
    _provider = TracerProvider(resource=Resource.create(attributes))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(_provider)
    _tracer = _provider.get_tracer("radixmesh")
    logs.trace_id_source = current_trace_id
    log.info("tracing on: OTLP/gRPC to %s", endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
             or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "localhost:4317")
    return True


def shutdown_tracing() -> None:
    """Export what is buffered and stop (also done at interpreter exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None
    logs.trace_id_source = None


def tracer():
    """The Tracer, or None when tracing is off."""
    return _tracer


def span(name: str, kind: str = "internal", **attributes: Any):
    """A context manager for a child span of the current one (made current inside), yielding it; a shared null
    context yielding None when tracing is off. `kind`: internal, server, client."""
    if _tracer is None:
        return _NULL
    return _tracer.start_as_current_span(name, kind=_kind(kind), attributes=_clean(attributes))


def root_span(name: str, headers: Mapping[str, str], **attributes: Any):
    """The server span of an incoming HTTP request: a child of the caller's W3C `traceparent` when the headers
    carry one, else the root of a new trace."""
    if _tracer is None:
        return _NULL
    from opentelemetry import propagate

    return _tracer.start_as_current_span(name, context=propagate.extract(headers), kind=_kind("server"),
                                         attributes=_clean(attributes))


def record_span(name: str, start: float, end: float, events: tuple = (), **attributes: Any) -> None:
    """A finished child of the current span from two time.monotonic() readings; `events`: (name, monotonic time,
    attributes) each. No-op when tracing is off."""
    if _tracer is None:
        return
    offset = time.time_ns() - time.monotonic_ns()
    s = _tracer.start_span(name, start_time=int(start * 1e9) + offset, attributes=_clean(attributes))
    for event, at, attrs in events:
        s.add_event(event, _clean(attrs), timestamp=int(at * 1e9) + offset)
    s.end(end_time=int(end * 1e9) + offset)


def start_span(name: str, kind: str = "client", **attributes: Any):
    """A child of the current span that is not made current (for a call that outlives the caller's frame, e.g. a
    streamed worker call); end it with `end_span`. None when tracing is off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, kind=_kind(kind), attributes=_clean(attributes))


def end_span(s, error: BaseException | None = None) -> None:
    """End a span from `start_span` (None: no-op); an Exception (not a cancellation) marks it failed."""
    if s is None:
        return
    if isinstance(error, Exception):
        from opentelemetry.trace import Status, StatusCode

        s.record_exception(error)
        s.set_status(Status(StatusCode.ERROR, str(error) or type(error).__name__))
    elif error is not None:
        s.set_attribute("radixmesh.cancelled", True)
    s.end()


def metadata_for(s) -> tuple | None:
    """gRPC metadata carrying span `s`'s context (W3C traceparent), for a call made outside it; None for None."""
    if s is None:
        return None
    from opentelemetry import propagate, trace

    carrier: dict = {}
    propagate.inject(carrier, context=trace.set_span_in_context(s))
    return tuple(carrier.items())


def current_span():
    """The current span (None when tracing is off or none is current)."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    s = trace.get_current_span()
    return s if s.get_span_context().is_valid else None


def set_attributes(**attributes: Any) -> None:
    """Set attributes on the current span (no-op when tracing is off)."""
    s = current_span()
    if s is not None:
        s.set_attributes(_clean(attributes))


def add_event(name: str, **attributes: Any) -> None:
    s = current_span()
    if s is not None:
        s.add_event(name, _clean(attributes))


def current_trace_id() -> str:
    """The current trace id as 32 hex digits, or "" (the logging filter's source)."""
    s = current_span()
    return format(s.get_span_context().trace_id, "032x") if s is not None else ""


@contextlib.contextmanager
def attached(carrier: Mapping[str, str]) -> Iterator[None]:
    """Make the trace context in `carrier` (W3C headers or gRPC metadata) current inside (no-op when off)."""
    if _tracer is None:
        yield
        return
    from opentelemetry import context, propagate

    token = context.attach(propagate.extract(carrier))
    try:
        yield
    finally:
        context.detach(token)


def inject(carrier: dict) -> dict:
    """Add the current trace context to `carrier` (W3C traceparent/tracestate); returns it."""
    if _tracer is not None:
        from opentelemetry import propagate

        propagate.inject(carrier)
    return carrier


def attributes(**values: Any) -> dict:
    """Span attributes as the helpers name them (`radixmesh.<name>` unless dotted; None values left out)."""
    return _clean(values)


def _kind(kind: str):
    from opentelemetry.trace import SpanKind

    return {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT}[kind]


def _clean(attributes: Mapping[str, Any]) -> dict:
    """Attribute names with `radixmesh.` unless they are already dotted (semantic-convention names); None dropped."""
    return {(k if "." in k else f"radixmesh.{k}"): v for k, v in attributes.items() if v is not None}
