"""Traces for every service: the flags, the set-up, span helpers that cost nothing when tracing is off, W3C trace
context in gRPC metadata (services.common.trace_grpc) and from HTTP traceparent, and the trace id in log lines.

    settings = TraceSettings(enable_trace=True, otlp_traces_endpoint="collector:4317")
    setup_tracing(settings, role="router")          # once, at start-up, before any channel or server is made
    with span("route", policy="cache_aware") as s:  # s is None when tracing is off
        ...
    record_span("queue", start_mono, end_mono)      # a span from time.monotonic() readings taken earlier

With tracing off (the default) nothing of it is imported: `span` returns a shared null context, no interceptor is
installed and log lines are unchanged. With it on, spans are recorded by a light recorder of our own
(services.common.trace_recorder: plain objects, one ContextVar, no OpenTelemetry SDK on the request path) and
shipped in batches through a pipe to an exporter process (trace_pipe, trace_export) that encodes OTLP and exports
over gRPC with the OpenTelemetry exporter, off the serving process's GIL; a bounded buffer drops (and counts)
spans rather than block when the collector is slow or down. The standard variables apply: OTEL_EXPORTER_OTLP_*
(endpoint, headers, timeout, TLS, compression), OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
OTEL_TRACES_SAMPLER[_ARG], OTEL_PROPAGATORS (tracecontext, baggage), OTEL_BSP_SCHEDULE_DELAY, _MAX_QUEUE_SIZE,
_MAX_EXPORT_BATCH_SIZE, _EXPORT_TIMEOUT, OTEL_SDK_DISABLED; --otlp-traces-endpoint wins over the variables."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from radixmesh.services.common import logs

log = logging.getLogger(__name__)

_NULL = contextlib.nullcontext()
INTERNAL, SERVER, CLIENT = 1, 2, 3  # OTLP SpanKind values (trace_recorder's)
_KINDS = {"internal": INTERNAL, "server": SERVER, "client": CLIENT}
# While tracing is on: the span pipe, and from services.common.trace_recorder / trace_context the Span class, the
# current-span ContextVar and the propagation settings (bound here so the off path imports none of them).
_pipe = None
_Span: Any = None
_Child: Any = None
_Root: Any = None
_current: Any = None
_propagation: Any = None
_Metadata: Any = None  # grpc.aio.Metadata
_extract: Any = None  # trace_context.extract
_call_traceparent: Any = None  # the traceparent of an open_call
_new_root: Any = None  # makes a _Root
_role = ""


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
    return _pipe is not None


def role() -> str:
    """The role given to setup_tracing ("" while tracing is off)."""
    return _role


def setup_tracing(settings: TraceSettings, role: str) -> bool:
    """Start recording spans for this process, exported by an exporter process of its own, when tracing is on;
    returns whether it is. Call once, before channels and servers are created (they pick their interceptors then).
    Spans still buffered are exported at interpreter exit (shutdown_tracing)."""
    global _pipe, _Span, _Child, _Root, _current, _propagation, _Metadata, _extract, _role
    global _call_traceparent, _new_root, open_call, close_call, leaf, clock
    global server_span, put_context, set_attribute, clear_context
    if not settings.enabled or _pipe is not None:
        return _pipe is not None
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.info("tracing off: OTEL_SDK_DISABLED=true")
        return False
    from grpc.aio import Metadata

    from radixmesh.services.common import trace_recorder
    from radixmesh.services.common.trace_context import Propagation, Sampler, extract
    from radixmesh.services.common.trace_pipe import SpanPipe, env_int, exporter_command

    endpoint = settings.otlp_traces_endpoint
    if endpoint is not None and "://" not in endpoint:
        endpoint = "http://" + endpoint  # a bare host:port is a plain-text collector, as SGLang's default
    batch = env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)
    native = trace_recorder.native  # the C recorder, where it is built: records go into its buffer
    pipe = SpanPipe(exporter_command(role, endpoint, batch), max_queue=env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048),
                    batch=batch, delay_s=env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000, native=native)
    sampler = Sampler.from_env()
    trace_recorder.configure(sampler, native.add if native is not None else pipe.add)
    _new_root, _Root, open_call, close_call, leaf, _call_traceparent = trace_recorder.api()
    clock = time.time_ns
    propagation = Propagation.from_env()
    if native is not None:  # the router's call sites in C, with this module's functions for what C leaves to them
        native.bind(*_PYTHON_HELPERS, propagation.tracecontext)
        server_span, put_context, set_attribute, clear_context = (
            native.server_span, native.put_context, native.set_attribute, native.clear_context)
    _pipe, _Span, _Child, _current, _propagation, _Metadata, _extract, _role = (
        pipe, trace_recorder.Span, trace_recorder.Child, trace_recorder.CURRENT, propagation, Metadata, extract, role)
    logs.trace_id_source = current_trace_id
    atexit.register(shutdown_tracing)
    log.info("tracing on: OTLP/gRPC to %s (sampler %s, %s recorder, exporter pid %d)", endpoint
             or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
             or "localhost:4317", sampler.name, trace_recorder_kind(), pipe.proc.pid)
    return True


def shutdown_tracing() -> None:
    """Export what is buffered and stop: the exporter process exports the rest and exits (bounded by
    OTEL_BSP_EXPORT_TIMEOUT, default 30 s; then it is killed). Also done at interpreter exit."""
    global _pipe, _role, server_span, put_context, set_attribute, clear_context
    pipe = _pipe
    _pipe, _role = None, ""  # the other globals stay bound: a span made by a racing thread still works
    server_span, put_context, set_attribute, clear_context = _PYTHON_HELPERS
    logs.trace_id_source = None
    if pipe is not None:
        from radixmesh.services.common.trace_pipe import env_int

        pipe.close(env_int("OTEL_BSP_EXPORT_TIMEOUT", 30000) / 1000)


def trace_recorder_kind() -> str:
    """"native" (services/common/_spanrec.c) or "python": the recorder in use while tracing is on ("" when off)."""
    if _pipe is None:
        return ""
    from radixmesh.services.common import trace_recorder

    return "native" if trace_recorder.native is not None else "python"


def tracer():
    """The span pipe (its `dropped` and `sent` counts, its exporter `proc`), or None when tracing is off."""
    return _pipe


def dropped_spans() -> int:
    """Spans dropped so far because the exporter or the collector did not keep up (0 when off)."""
    return _pipe.dropped if _pipe is not None else 0


def span(name: str, kind: str = "internal", **attributes: Any):
    """A context manager for a child span of the current one (made current inside), yielding it; a shared null
    context yielding None when tracing is off. `kind`: internal, server, client."""
    if _pipe is None:
        return _NULL
    return _Span(name, _KINDS[kind], attributes, _current.get())


def root_span(name: str, headers: Mapping[str, str], owned: dict | None = None, /, **attributes: Any):
    """The server span of an incoming HTTP request or gRPC call: a child of the caller's W3C `traceparent` when
    `headers` carry one, else the root of a new trace. Attributes: `owned` (a dict the span keeps and changes) or
    the keywords."""
    if _pipe is None:
        return _NULL
    # most requests come without a traceparent: one lookup, not the whole extraction
    remote = _extract(headers, _propagation) if "traceparent" in headers else None
    return _Span(name, 2, attributes if owned is None else owned,
                 _Span.remote(remote) if remote is not None else None)


def server_span(headers: Mapping[str, str]):
    """The server span of an incoming HTTP request, made current, or None when tracing is off: a child of the
    caller's W3C `traceparent` when `headers` carry one, else the root of a new trace (a trace_recorder.Root:
    cheaper than root_span's Span). End it with its `finish(name, names, values, error)`: named then, attributes
    `values` under `names`; `error` an escaping Exception (recorded, the span failed), a description of a failure
    (the span failed) or a cancellation (marked); the span current before it is current again."""
    if _pipe is None:
        return None
    if "traceparent" in headers:
        remote = _extract(headers, _propagation)
        if remote is not None:
            return _Span("", 2, {}, _Span.remote(remote)).begin()
    return _new_root()


def wall_offset_ns() -> int:
    """Wall clock minus monotonic clock, in ns: what record_span adds to a monotonic reading. Two readings of it
    differ by a few ns (the two clocks are not read at once), so spans that must meet end to end take one."""
    return time.time_ns() - time.monotonic_ns()


def record_span(name: str, start: float, end: float, events: tuple = (), *, offset_ns: int | None = None,
                **attributes: Any) -> None:
    """A finished child of the current span from two time.monotonic() readings; `events`: (name, monotonic time,
    attributes) each; `offset_ns`: a wall_offset_ns() shared with the spans this one meets (None: a fresh one).
    No-op when tracing is off."""
    if _pipe is None:
        return
    offset = wall_offset_ns() if offset_ns is None else offset_ns
    s = _Span(name, 1, attributes, _current.get(), int(start * 1e9) + offset)
    for event, at, attrs in events:
        s.add_event(event, attrs, int(at * 1e9) + offset)
    s.end(int(end * 1e9) + offset)


def start_span(name: str, kind: str = "client", **attributes: Any):
    """A child of the current span that is not made current (a call that outlives the caller's frame, e.g. a
    streamed worker call, or a decision with no spans under it); end it with `end_span`. None when tracing is off.
    Under a local span it is a trace_recorder.Child (sent inside its parent's record)."""
    if _pipe is None:
        return None
    parent = _current.get()
    if type(parent) is _Span or type(parent) is _Root:
        return _Child(name, _KINDS[kind], attributes, parent)
    return _Span(name, _KINDS[kind], attributes, parent)


def end_span(s, error: BaseException | None = None) -> None:
    """End a span from `start_span` (None: no-op); an Exception (not a cancellation) marks it failed."""
    if s is None:
        return
    if isinstance(error, Exception):
        s.record_exception(error)
        s.set_error(str(error) or type(error).__name__)
    elif error is not None:
        s.set_attribute("radixmesh.cancelled", True)
    s.end()


# Spans for the request path of a busy service (the router's), recorded as tuples instead of span objects, with
# attributes as positional values under a constant tuple of names: a fraction of span()/start_span()'s cost.
# Bound to trace_recorder's functions while tracing is on; callers test what `clock`/`open_call` gave first.

def clock() -> int:
    """time.time_ns() while tracing is on (bound to it then), else 0: the start of a `leaf`."""
    return 0


def leaf(name: str, kind: int, start_ns: int, names: tuple, values: tuple, error: BaseException | None = None
         ) -> None:
    """A finished child of the current span, begun at `start_ns` (from `clock`), ending now, never current and
    with no context sent anywhere (a routing decision); attributes: `values` under `names`. `error`: as end_span
    takes it. trace_recorder.leaf while tracing is on."""


def open_call():
    """A client span for a call whose context goes with it (put_context, metadata_for), not made current: an
    opaque value to end with `close_call`, None when tracing is off or no span is current."""
    return None


def close_call(opened, name: str, kind: int, names: tuple, values: tuple, error: BaseException | None = None
               ) -> None:
    """End a span from `open_call` (not None), named and given its attributes now (as `leaf`)."""


def _context_of(s) -> tuple[str, Any]:
    """(traceparent, the trace's origin) of a span, a Child or an `open_call` value."""
    if type(s) is tuple:
        return _call_traceparent(s), s[0].origin
    return s.traceparent(), s.origin


def metadata_for(s):
    """gRPC metadata (a grpc.aio.Metadata: grpc.aio takes it as it is, where a tuple is converted per call)
    carrying span `s`'s context (W3C traceparent, tracestate, baggage); None for None."""
    if s is None or _propagation is None or not _propagation.tracecontext:
        return None
    value, o = _context_of(s)  # o: the caller's span the trace came from: its tracestate and baggage travel on
    md = _Metadata(("traceparent", value))
    if o is not None:
        if o.tracestate:
            md.add("tracestate", o.tracestate)
        if o.baggage and _propagation.baggage:
            md.add("baggage", o.baggage)
    return md


def put_context(target, s) -> bool:
    """Write span `s`'s context (W3C traceparent, tracestate, baggage) into `target`'s fields of those names (a
    GenerateRequest or TokenizeRequest sent over a stream: see carried_context); False (nothing written) for None
    or with tracecontext propagation off. Setting the fields costs a quarter of building gRPC metadata."""
    if s is None or _propagation is None or not _propagation.tracecontext:
        return False
    if type(s) is tuple:  # an open_call, the router's calls: inline, as its every request makes one
        target.traceparent = _call_traceparent(s)
        o = s[0].origin
    else:
        target.traceparent, o = _context_of(s)
    if o is not None:
        if o.tracestate:
            target.tracestate = o.tracestate
        if o.baggage and _propagation.baggage:
            target.baggage = o.baggage
    return True


def clear_context(target, s) -> None:
    """Undo put_context(target, s): `target`'s traceparent, tracestate and baggage fields emptied."""
    target.traceparent = target.tracestate = target.baggage = ""


def carried_context(request) -> dict[str, str] | None:
    """The W3C context a request received over a stream carries in its traceparent, tracestate and baggage fields
    (put_context), as the headers root_span reads; None when it carries none or tracing is off."""
    if not request.traceparent or _pipe is None:
        return None
    return {"traceparent": request.traceparent, "tracestate": request.tracestate, "baggage": request.baggage}


def current_metadata():
    """gRPC metadata carrying the current span's context, for a call made inside it without a client interceptor
    (the router's calls); None when tracing is off or no span is current."""
    return metadata_for(_current.get()) if _pipe is not None else None


def current_span():
    """The current span (None when tracing is off or none is current)."""
    return _current.get() if _pipe is not None else None


def set_attribute(key: str, value: Any) -> None:
    """Set one attribute on the current span (no-op when tracing is off); cheaper than set_attributes."""
    if _pipe is not None:
        s = _current.get()
        if s is not None:
            s.set_attribute(key, value)


def set_attributes(**attributes: Any) -> None:
    """Set attributes on the current span (no-op when tracing is off)."""
    s = current_span()
    if s is not None:
        s.set_attributes(attributes)


# The Python versions of the helpers the native recorder takes over while tracing is on (setup_tracing)
_PYTHON_HELPERS = (server_span, put_context, set_attribute, clear_context)


def add_event(name: str, **attributes: Any) -> None:
    s = current_span()
    if s is not None:
        s.add_event(name, attributes)


def current_trace_id() -> str:
    """The current trace id as 32 hex digits, or "" (the logging filter's source)."""
    s = current_span()
    return s.trace_id_hex if s is not None else ""


@contextlib.contextmanager
def attached(carrier: Mapping[str, str]) -> Iterator[None]:
    """Make the trace context in `carrier` (W3C headers or gRPC metadata) current inside (no-op when off)."""
    if _pipe is None:
        yield
        return
    remote = _extract(carrier, _propagation)
    token = _current.set(_Span.remote(remote) if remote is not None else None)
    try:
        yield
    finally:
        _current.reset(token)


def inject(carrier: dict) -> dict:
    """Add the current trace context to `carrier` (W3C traceparent/tracestate, baggage); returns it."""
    for key, value in current_metadata() or ():
        carrier[key] = value
    return carrier


def attributes(**values: Any) -> dict:
    """Span attributes as the helpers name them (`radixmesh.<name>` unless dotted; None values left out)."""
    return _clean(values)


def _clean(attributes: Mapping[str, Any]) -> dict:
    """Attribute names with `radixmesh.` unless they are already dotted (semantic-convention names); None dropped."""
    return {(k if "." in k else f"radixmesh.{k}"): v for k, v in attributes.items() if v is not None}
