"""Traces for every service on the OpenTelemetry SDK: the flags, the set-up, span helpers that cost nothing when
tracing is off, W3C trace context in gRPC metadata (services.common.trace_grpc), in the requests of a stream lane
(put_context, carried_context) and from an HTTP traceparent, and the trace id in log lines.

    settings = TraceSettings(enable_trace=True, otlp_traces_endpoint="collector:4317")
    setup_tracing(settings, role="router")          # once, at start-up, before any channel or server is made
    with span("route", policy="cache_aware") as s:  # s is None when tracing is off or the request is not sampled
        ...
    record_span("queue", start_mono, end_mono)      # a span from time.monotonic() readings taken earlier

With tracing off (the default) nothing of OpenTelemetry is imported: `span` returns a shared null context, no
interceptor is installed and log lines are unchanged. With it on, a TracerProvider samples new traces with
ParentBased(TraceIdRatioBased(--trace-sample-ratio)) and a BatchSpanProcessor hands finished spans to the OTLP/gRPC
exporter on a thread of its own. Only a server span (an incoming request or call: server_span, root_span) starts a
trace; every other helper makes a child of the current span, and nothing at all while no sampled span is current,
so a request the sampler left out costs one sampling decision (made on the new trace's id before the SDK makes any
span) and a ContextVar read per helper. A caller's sampled traceparent is always followed.

The standard variables apply: OTEL_EXPORTER_OTLP_* (endpoint, headers, timeout, TLS, compression),
OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_PROPAGATORS, OTEL_BSP_SCHEDULE_DELAY, _MAX_QUEUE_SIZE,
_MAX_EXPORT_BATCH_SIZE, _EXPORT_TIMEOUT, OTEL_SDK_DISABLED, and OTEL_TRACES_SAMPLER[_ARG] when no
--trace-sample-ratio is given. Our flags win over the variables."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from random import getrandbits
from typing import Any, Mapping

from radixmesh.services.common import logs

log = logging.getLogger(__name__)

# Without a flag or OTEL_TRACES_SAMPLER, the share of new traces kept. The budget is 3% of the router's CPU per
# request; a traced request costs it 81-91% more, so SGLang's trace-everything (ratio 1.0) is an opt-in and this
# default costs +0.7-1.9% (benchmarks/results/NOTES.md, 2026-12-04).
DEFAULT_SAMPLE_RATIO = 0.01
SERVICE_PREFIX = "radixmesh-"  # service.name = radixmesh-<role> unless OTEL_SERVICE_NAME says otherwise
SCOPE = "radixmesh"
INTERNAL, SERVER, CLIENT = "internal", "server", "client"

_NULL = contextlib.nullcontext()
# True while a sampled span of ours is current (_Current, _ServerSpan set it with the SDK's context): what every
# helper tests first, a tenth of the SDK's get_current_span, as a request the sampler left out makes several tests
_sampled: ContextVar[bool] = ContextVar("radixmesh_sampled", default=False)
# Bound by setup_tracing while tracing is on, so that the off path imports nothing of OpenTelemetry. shutdown_tracing
# unbinds the provider only: a span still being made by a racing thread is made (and dropped by the processor).
_provider: Any = None
_tracer: Any = None
_sampler: Any = None
_ids: Any = None  # the provider's id generator (_trace_ids)
# With our ratio sampler: TraceIdRatioBased's bound for the ratio and its id mask (a trace is kept when its id's
# low 64 bits are below the bound), for the decision on a new trace in a few instructions where the sampler's own
# should_sample takes 14.5k (callgrind); None with a sampler from OTEL_TRACES_SAMPLER, which is asked
_bound: int | None = None
_limit = 0
_kinds: dict = {}  # "internal", "server", "client" -> SpanKind
_current: Any = None  # opentelemetry.trace.get_current_span
_in_context: Any = None  # opentelemetry.trace.set_span_in_context
_attach: Any = None
_detach: Any = None
_propagator: Any = None  # the global text-map propagator (OTEL_PROPAGATORS: tracecontext, baggage by default)
_new_trace: Any = None  # an empty Context: the parent of a span that starts a trace
_Metadata: Any = None  # grpc.aio.Metadata
_error: Any = None  # a Status of StatusCode.ERROR from a description
_role = ""
_NAMES: dict[str, str] = {}  # attribute names as given -> as exported (see _name)


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """The tracing flags every service takes (pass it to parse_settings as an extra class)."""

    enable_trace: bool = field(default=False, metadata={
        "help": "export OpenTelemetry traces over OTLP/gRPC (one trace per sampled request across the services)"})
    otlp_traces_endpoint: str | None = field(default=None, metadata={
        "help": "host:port (or http[s]://host:port) of the OTLP/gRPC trace collector (default: "
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT, else localhost:4317); giving it "
                "turns tracing on"})
    trace_sample_ratio: float | None = field(default=None, metadata={
        "help": f"the share of new traces kept, in [0, 1] (default: OTEL_TRACES_SAMPLER[_ARG] when set, else "
                f"{DEFAULT_SAMPLE_RATIO}); 1.0 traces every request. A request whose caller sent a sampled W3C "
                f"traceparent is always traced"})

    def __post_init__(self) -> None:
        ratio = self.trace_sample_ratio
        if ratio is not None and not 0.0 <= ratio <= 1.0:  # (NaN fails the comparison too)
            raise ValueError(f"--trace-sample-ratio must be in [0, 1] (1.0 traces every request), got {ratio}")

    @property
    def enabled(self) -> bool:
        return self.enable_trace or self.otlp_traces_endpoint is not None


def settings_or_exit(kwargs: dict) -> TraceSettings:
    """TraceSettings from parsed flags, or exit with the reason (a bad --trace-sample-ratio)."""
    try:
        return TraceSettings(**kwargs)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def enabled() -> bool:
    return _provider is not None


def role() -> str:
    """The role given to setup_tracing ("" while tracing is off)."""
    return _role


def tracer():
    """The SDK Tracer spans are made with, or None when tracing is off."""
    return _tracer if _provider is not None else None


def setup_tracing(settings: TraceSettings, role: str) -> bool:
    """Start tracing this process when the settings ask for it; returns whether it is on. Call once, before channels
    and servers are created (they pick their interceptors then). Spans still buffered are exported at interpreter
    exit (the provider's own exit hook) or by shutdown_tracing."""
    global _provider, _role
    if not settings.enabled or _provider is not None:
        return _provider is not None
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.info("tracing off: OTEL_SDK_DISABLED=true")
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    endpoint = settings.otlp_traces_endpoint
    if endpoint is not None and "://" not in endpoint:
        endpoint = "http://" + endpoint  # a bare host:port is a plain-text collector, as SGLang's default
    chosen = sampler(settings)
    provider = TracerProvider(sampler=chosen, resource=_resource(role), id_generator=_trace_ids())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)  # so any library's own instrumentation joins the same traces
    _bind(provider, None if chosen is None else _ratio(settings))
    _provider, _role = provider, role
    logs.trace_id_source = current_trace_id
    log.info("tracing on: OTLP/gRPC to %s, sampler %s", endpoint or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "localhost:4317",
        provider.sampler.get_description())
    return True


def sampler(settings: TraceSettings, env: Mapping[str, str] | None = None):
    """The sampler for new spans: ParentBased(TraceIdRatioBased(ratio)) with --trace-sample-ratio when given; else
    None (the SDK's own reading of OTEL_TRACES_SAMPLER and _ARG) when that is set; else the parent-based ratio at
    DEFAULT_SAMPLE_RATIO. Parent-based: a span with a parent (a caller's traceparent) follows its sampled flag."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    env = os.environ if env is None else env
    if settings.trace_sample_ratio is None and env.get("OTEL_TRACES_SAMPLER", "").strip():
        return None
    return ParentBased(TraceIdRatioBased(_ratio(settings)))


def _ratio(settings: TraceSettings) -> float:
    return DEFAULT_SAMPLE_RATIO if settings.trace_sample_ratio is None else settings.trace_sample_ratio


def _resource(role: str):
    """service.name radixmesh-<role> (unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names one) and
    radixmesh.role, over what the SDK reads from the variables."""
    from opentelemetry.sdk.resources import Resource

    attributes = {"radixmesh.role": role}
    if "OTEL_SERVICE_NAME" not in os.environ and "service.name=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes["service.name"] = SERVICE_PREFIX + role
    return Resource.create(attributes)


def _trace_ids():
    """The SDK's random ids, except that the next trace id can be given (`given`): the one server_span sampled
    before the SDK makes the span. Only the event loop's thread gives one, right before it makes that span; another
    thread starting a trace in between would take it (both spans then sampled by the SDK on their own ids)."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class GivenTraceIds(RandomIdGenerator):
        given = 0

        def generate_trace_id(self) -> int:
            given, self.given = self.given, 0
            return given or super().generate_trace_id()

    return GivenTraceIds()


def _bind(provider, ratio: float | None) -> None:
    """Bind the module's SDK collaborators (what the helpers use once tracing is on); `ratio`: our ratio sampler's,
    None for a sampler of the SDK's choosing."""
    global _tracer, _sampler, _ids, _kinds, _current, _in_context, _attach, _detach, _propagator, _new_trace
    global _Metadata, _error, _bound, _limit
    from grpc.aio import Metadata
    from opentelemetry import context, propagate, trace
    from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

    _bound = None if ratio is None else TraceIdRatioBased.get_bound_for_rate(ratio)
    _limit = TraceIdRatioBased.TRACE_ID_LIMIT
    _kinds = {INTERNAL: trace.SpanKind.INTERNAL, SERVER: trace.SpanKind.SERVER, CLIENT: trace.SpanKind.CLIENT}
    _current, _in_context = trace.get_current_span, trace.set_span_in_context
    _attach, _detach, _new_trace = context.attach, context.detach, context.Context()
    _propagator, _Metadata = propagate.get_global_textmap(), Metadata
    _error = lambda description: trace.Status(trace.StatusCode.ERROR, description)  # noqa: E731
    _tracer, _sampler, _ids = provider.get_tracer(SCOPE), provider.sampler, provider.id_generator


def shutdown_tracing() -> None:
    """Export what is buffered and stop (bounded by OTEL_BSP_EXPORT_TIMEOUT and the exporter's timeout). Also done
    at interpreter exit."""
    global _provider, _role
    provider = _provider
    _provider, _role = None, ""
    logs.trace_id_source = None
    if provider is not None:
        provider.shutdown()


def _make_current(s, context) -> tuple:
    """Make span `s` current (in `context`, None: the current one); returns what _restore takes."""
    return _attach(_in_context(s, context)), _sampled.set(s.is_recording())


def _restore(tokens: tuple) -> None:
    """Make current again what was before _make_current."""
    context, sampled = tokens
    try:
        _sampled.reset(sampled)
    except (ValueError, RuntimeError):  # restored in another context than it was set in (a generator closed elsewhere)
        pass
    _detach(context)


class _Current:
    """A span made current inside `with` (in `context`, else the current context) and ended at its end: an escaping
    Exception marks it failed, a cancellation is marked (radixmesh.cancelled)."""

    __slots__ = ("span", "context", "tokens")

    def __init__(self, span, context=None):
        self.span, self.context = span, context

    def __enter__(self):
        self.tokens = _make_current(self.span, self.context)
        return self.span

    def __exit__(self, kind, exc, tb) -> None:
        _restore(self.tokens)
        if exc is not None:
            _failed(self.span, exc)
        self.span.end()


class _ServerSpan:
    """The router's HTTP request span, current until `finish` (it ends in another frame than it began in)."""

    __slots__ = ("span", "tokens")

    def __init__(self, span, context):
        self.span, self.tokens = span, _make_current(span, context)

    def finish(self, name: str, names: tuple, values: tuple, error: BaseException | str | None = None) -> None:
        """End the span, named `name`, with attributes `values` under `names`; `error` as _failed takes it. The
        context current before it is current again."""
        _restore(self.tokens)
        s = self.span
        s.update_name(name)
        s.set_attributes(_zip(names, values))
        if error is not None:
            _failed(s, error)
        s.end()


def _failed(s, error: BaseException | str) -> None:
    """Mark a span that ends with `error`: a description of a failure or an Exception (recorded as an event) fail
    it; a cancellation (another BaseException) is marked."""
    if isinstance(error, str):
        s.set_status(_error(error))
    elif isinstance(error, Exception):
        s.record_exception(error)
        s.set_status(_error(f"{type(error).__name__}: {error}"))
    else:
        s.set_attribute("radixmesh.cancelled", True)


def span(name: str, kind: str = INTERNAL, **attributes: Any):
    """A context manager for a child of the current span (made current inside), yielding it; a shared null context
    yielding None when tracing is off or no sampled span is current. `kind`: internal, server, client."""
    if not _sampled.get():
        return _NULL
    return _Current(_tracer.start_span(name, kind=_kinds[kind], attributes=_clean(attributes)))


def root_span(name: str, headers: Mapping[str, str], **attributes: Any):
    """The server span of an incoming call, made current inside: a child of the caller's W3C context in `headers`
    (traceparent, tracestate, baggage), else the root of a new trace, sampled by the sampler; a null context when
    tracing is off."""
    if _provider is None:
        return _NULL
    parent = _propagator.extract(headers)
    return _Current(_tracer.start_span(name, parent, _kinds[SERVER], _clean(attributes)), parent)


def server_span(headers: Mapping[str, str]) -> _ServerSpan | None:
    """The server span of an incoming HTTP request, made current until its `finish(name, names, values, error)`;
    None when tracing is off or the request is not sampled (then nothing is current: no child span, no context
    sent on). A child of the caller's `traceparent` when `headers` carry one, else the root of a new trace."""
    if _provider is None:
        return None
    if "traceparent" in headers:
        parent = _propagator.extract(headers)
    else:  # most requests: a new trace, decided on its id before the SDK makes anything
        trace_id = getrandbits(128)  # as the SDK's RandomIdGenerator draws it, without its two calls
        if not _keeps_new(trace_id):
            return None
        parent, _ids.given = _new_trace, trace_id  # the span gets the kept id (and the SDK's same decision)
    s = _tracer.start_span("HTTP", parent, _kinds[SERVER])
    return _ServerSpan(s, parent) if s.is_recording() else None


def _keeps_new(trace_id: int) -> bool:
    """Whether the sampler keeps a new trace of this id: TraceIdRatioBased's rule inline for our ratio sampler (what
    its should_sample decides for a span without a parent), else the sampler asked."""
    if _bound is not None:
        return trace_id & _limit < _bound
    return _sampler.should_sample(_new_trace, trace_id, "HTTP").decision.is_sampled()


def wall_offset_ns() -> int:
    """Wall clock minus monotonic clock, in ns: what record_span adds to a monotonic reading. Two readings of it
    differ by a few ns (the two clocks are not read at once), so spans that must meet end to end take one."""
    return time.time_ns() - time.monotonic_ns()


def record_span(name: str, start: float, end: float, events: tuple = (), *, offset_ns: int | None = None,
                **attributes: Any) -> None:
    """A finished child of the current span from two time.monotonic() readings; `events`: (name, monotonic time,
    attributes) each; `offset_ns`: a wall_offset_ns() shared with the spans this one meets (None: a fresh one).
    No-op when tracing is off or no sampled span is current."""
    if not _sampled.get():
        return
    offset = wall_offset_ns() if offset_ns is None else offset_ns
    s = _tracer.start_span(name, attributes=_clean(attributes), start_time=int(start * 1e9) + offset)
    for event, at, attrs in events:
        s.add_event(event, _clean(attrs), int(at * 1e9) + offset)
    s.end(int(end * 1e9) + offset)


def start_span(name: str, kind: str = CLIENT, **attributes: Any):
    """A child of the current span that is not made current (a call that outlives the caller's frame); end it with
    `end_span`. None when tracing is off or no sampled span is current."""
    if not _sampled.get():
        return None
    return _tracer.start_span(name, kind=_kinds[kind], attributes=_clean(attributes))


def end_span(s, error: BaseException | None = None) -> None:
    """End a span from `start_span` (None: no-op); `error` as _failed takes it."""
    if s is not None:
        if error is not None:
            _failed(s, error)
        s.end()


def clock() -> int:
    """time.time_ns() while a sampled span is current, else 0: the start of a `leaf` (callers test it first)."""
    return time.time_ns() if _sampled.get() else 0


def leaf(name: str, kind: str, start_ns: int, names: tuple, values: tuple, error: BaseException | None = None
         ) -> None:
    """A finished child of the current span, begun at `start_ns` (from `clock`, not 0), ending now, never current
    (a routing decision, a failed call); attributes: `values` under `names`; `error` as _failed takes it."""
    s = _tracer.start_span(name, kind=_kinds[kind], attributes=_zip(names, values), start_time=start_ns)
    if error is not None:
        _failed(s, error)
    s.end()


def _carrier(s) -> dict[str, str]:
    """Span `s`'s context as the propagators write it (traceparent, tracestate, baggage; none with
    OTEL_PROPAGATORS=none)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, _in_context(s))
    return carrier


def metadata_for(s):
    """gRPC metadata (a grpc.aio.Metadata: grpc.aio takes it as it is) carrying span `s`'s context; None for None
    or when the propagators write nothing."""
    if s is None:
        return None
    carrier = _carrier(s)
    return _Metadata(*carrier.items()) if carrier else None


def put_context(target, s) -> bool:
    """Write span `s`'s W3C context into `target`'s traceparent, tracestate and baggage fields (a GenerateRequest or
    TokenizeRequest sent over a stream lane: see carried_context); False (nothing written) for None or with
    tracecontext propagation off."""
    if s is None:
        return False
    carrier = _carrier(s)
    if "traceparent" not in carrier:
        return False
    target.traceparent = carrier["traceparent"]
    target.tracestate = carrier.get("tracestate", "")
    target.baggage = carrier.get("baggage", "")
    return True


def clear_context(target, s) -> None:
    """Undo put_context(target, s): `target`'s traceparent, tracestate and baggage fields emptied."""
    target.traceparent = target.tracestate = target.baggage = ""


def carried_context(request) -> dict[str, str] | None:
    """The W3C context a request received over a stream lane carries in its traceparent, tracestate and baggage
    fields (put_context), as the headers root_span reads; None when it carries none or tracing is off."""
    if not request.traceparent or _provider is None:
        return None
    return {"traceparent": request.traceparent, "tracestate": request.tracestate, "baggage": request.baggage}


def current_metadata():
    """gRPC metadata carrying the current span's context, for a call made inside it without a client interceptor
    (the router's calls); None when tracing is off or no sampled span is current."""
    return metadata_for(_current()) if _sampled.get() else None


def current_span():
    """The current span when it is sampled; None when tracing is off or there is none."""
    return _current() if _sampled.get() else None


def set_attribute(key: str, value: Any) -> None:
    """Set one attribute on the current sampled span (no-op otherwise, or for None)."""
    if value is not None and _sampled.get():
        _current().set_attribute(_name(key), value)


def set_attributes(**attributes: Any) -> None:
    """Set attributes on the current sampled span (no-op otherwise; None values left out)."""
    s = current_span()
    if s is not None:
        s.set_attributes(_clean(attributes))


def add_event(name: str, **attributes: Any) -> None:
    s = current_span()
    if s is not None:
        s.add_event(name, _clean(attributes))


def current_trace_id() -> str:
    """The current trace id as 32 hex digits, or "" (the logging filter's source)."""
    if _current is None:
        return ""
    ctx = _current().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def _name(key: str) -> str:
    """An attribute's exported name: `radixmesh.<key>` unless dotted (a semantic-convention name)."""
    name = _NAMES.get(key)
    if name is None:  # the names are the call sites' constants: a bounded set
        name = _NAMES[key] = key if "." in key else f"radixmesh.{key}"
    return name


def _clean(attributes: Mapping[str, Any]) -> dict:
    """Attributes as exported: names through _name, None values dropped."""
    return {_name(k): v for k, v in attributes.items() if v is not None}


def _zip(names: tuple, values: tuple) -> dict:
    return {_name(k): v for k, v in zip(names, values) if v is not None}
