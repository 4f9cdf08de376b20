"""The span recorder behind services.common.tracing while tracing is on. A span is a slotted object: ids from
random.getrandbits, times from time.time_ns, attributes in the dict the caller passed. One ContextVar holds the
current span. A finished sampled span becomes one `marshal`led tuple (`Record`'s fields, in order) handed to the
sink (services.common.trace_pipe.SpanPipe.add), which ships batches to the exporter process; nothing here imports
OpenTelemetry and no OTLP is encoded in the serving process. Marshalling at the end (~0.5 us) leaves nothing the
garbage collector tracks waiting in the buffer: a queued tuple and its dict would each count towards the next
collection and get traversed there, which costs the process more than the marshalling.

Attribute names are stored as the call sites give them: bare names get their `radixmesh.` prefix and None values
are dropped in the exporter process (trace_export.add_attributes), off the serving process's CPU."""

from __future__ import annotations

import traceback
from contextvars import ContextVar
from marshal import dumps
from random import getrandbits
from time import time_ns
from typing import Any, Callable, NamedTuple

from services.common.trace_context import LOW64, RemoteContext, Sampler, traceparent

INTERNAL, SERVER, CLIENT = 1, 2, 3  # OTLP Span.SpanKind values
MARSHAL_VERSION = 2  # no back-references: ~40% faster to write than the default for these small records
STATUS_ERROR = 2  # OTLP Status.StatusCode value


class Record(NamedTuple):
    """What the exporter process receives per span (sent as a plain tuple)."""

    trace_id: int
    span_id: int
    parent_id: int  # 0 for a root
    parent_remote: bool  # the parent came from another process (traceparent)
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    events: list | None  # [(name, time_ns, attributes dict)]
    status: tuple | None  # (STATUS_ERROR, description)
    tracestate: str


CURRENT: ContextVar["Span | None"] = ContextVar("radixmesh_span", default=None)
# The sampler, unpacked: new spans are decided inline (a call per span costs more than the decision itself)
_parent_based, _bound = True, 1 << 64
_sink: Callable[[bytes], None] = lambda record: None  # noqa: E731


def configure(sampler: Sampler, sink: Callable[[bytes], None]) -> None:
    """Where finished spans go (marshalled Record tuples) and how new ones are sampled (tracing.setup_tracing)."""
    global _parent_based, _bound, _sink
    _parent_based, _bound, _sink = sampler.parent_based, sampler.bound, sink


def _new_id(bits: int) -> int:
    value = getrandbits(bits)
    while not value:  # an all-zero id is invalid in W3C trace context
        value = getrandbits(bits)
    return value


class Span:
    """One span. `with span:` makes it current inside and ends it (an escaping Exception marks it failed, as the
    OpenTelemetry SDK does); otherwise end it with `end()`. Methods modify the span in place; on a span that is not
    sampled (or a remote parent) they change nothing that is exported."""

    __slots__ = ("name", "kind", "trace_id", "span_id", "parent_id", "parent_remote", "sampled", "recording",
                 "start_ns", "attributes", "events", "status", "tracestate", "baggage", "_token")

    def __init__(self, name: str, kind: int, attributes: dict, parent: "Span | None", start_ns: int = 0):
        self.name, self.kind, self.attributes = name, kind, attributes
        self.span_id = getrandbits(64) or _new_id(64)
        if parent is None:
            self.trace_id = trace_id = getrandbits(128) or _new_id(128)
            self.parent_id, self.parent_remote, self.tracestate, self.baggage = 0, False, "", ""
            self.sampled = self.recording = (trace_id & LOW64) < _bound
        else:
            self.trace_id = trace_id = parent.trace_id
            self.parent_id, self.parent_remote = parent.span_id, parent.kind == 0
            self.tracestate, self.baggage = parent.tracestate, parent.baggage
            self.sampled = self.recording = parent.sampled if _parent_based else (trace_id & LOW64) < _bound
        self.start_ns = start_ns or time_ns()
        self.events = self.status = None

    @classmethod
    def remote(cls, ctx: RemoteContext) -> "Span":
        """A stand-in for a caller's span (kind 0, never recorded), the parent of this process's first span."""
        s = cls.__new__(cls)
        s.name, s.kind, s.attributes, s.events, s.status = "", 0, {}, None, None
        s.trace_id, s.span_id, s.sampled, s.tracestate, s.baggage = ctx
        s.parent_id, s.parent_remote, s.recording, s.start_ns = 0, False, False, 0
        return s

    def __enter__(self) -> "Span":
        self._token = CURRENT.set(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            CURRENT.reset(self._token)
        except ValueError:  # left in another context than it was entered in (a generator closed elsewhere)
            pass
        if isinstance(exc, Exception) and self.recording:
            self.record_exception(exc)
            if self.status is None:
                self.status = (STATUS_ERROR, f"{type(exc).__name__}: {exc}")
        self.end()

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: dict) -> None:
        self.attributes.update(attributes)

    def add_event(self, name: str, attributes: dict | None = None, timestamp: int | None = None) -> None:
        if self.recording:
            if self.events is None:
                self.events = []
            self.events.append((name, timestamp or time_ns(), attributes or {}))

    def set_error(self, description: str) -> None:
        """Mark the span failed (status ERROR with `description`)."""
        self.status = (STATUS_ERROR, description)

    def record_exception(self, exc: BaseException) -> None:
        """An `exception` event with the semantic-convention attributes (type, message, stacktrace)."""
        if not self.recording:
            return
        module, qualname = type(exc).__module__, type(exc).__qualname__
        self.add_event("exception", {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exc),
            "exception.stacktrace": "".join(traceback.format_exception(exc)),
            "exception.escaped": "False"})

    def is_recording(self) -> bool:
        return self.recording

    def end(self, end_ns: int | None = None) -> None:
        """Finish the span (once; later calls do nothing) and hand it to the sink if it is sampled."""
        if self.recording:
            self.recording = False
            try:
                record = dumps((self.trace_id, self.span_id, self.parent_id, self.parent_remote, self.name, self.kind,
                                self.start_ns, end_ns or time_ns(), self.attributes, self.events, self.status,
                                self.tracestate), MARSHAL_VERSION)
            except ValueError:  # an attribute value marshal does not write
                record = dumps(plain(self, end_ns or time_ns()), MARSHAL_VERSION)
            _sink(record)

    @property
    def trace_id_hex(self) -> str:
        return f"{self.trace_id:032x}"

    def traceparent(self) -> str:
        return traceparent(self.trace_id, self.span_id, self.sampled)


def plain(s: Span, end_ns: int) -> tuple:
    """`s` as a Record whose attribute values marshal can write (others as their str())."""
    attributes = {k: _plain_value(v) for k, v in s.attributes.items()}
    events = [(name, at, {k: _plain_value(v) for k, v in attrs.items()}) for name, at, attrs in s.events or ()]
    return (s.trace_id, s.span_id, s.parent_id, s.parent_remote, s.name, s.kind, s.start_ns, end_ns, attributes,
            events or None, s.status, s.tracestate)


def _plain_value(v: Any) -> Any:
    if v is None or isinstance(v, (str, bool, int, float, bytes)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (str, bool, int, float)) for x in v):
        return list(v)
    return str(v)
