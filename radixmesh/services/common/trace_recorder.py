"""The span recorder behind services.common.tracing while tracing is on. A span is a slotted object: ids from
random.getrandbits, times from time.time_ns, attributes in the dict the caller passed, and a reference to its
parent (a local span, a `Remote` stand-in for a caller's span, or None for a root) from which it reads its trace's
id, tracestate and baggage. A request whose trace begins in this process (the router's HTTP requests, mostly) has
a lighter `Root` as its server span. One ContextVar holds the current span. A finished sampled span becomes one
plain tuple (`Record`'s fields, in order) handed to the sink (services.common.trace_pipe.SpanPipe.add); the
pipe's writer thread marshals a batch of them at once (`encode_batch`) for the exporter process. Nothing here
imports OpenTelemetry and no OTLP is encoded in the serving process.

Where the native recorder is built (services/common/_spanrec.c, `make` builds it), the router's per-request spans
(its Root, open_call / close_call, leaf) are made and recorded in C, and every record, the Python spans' too, is
encoded as OTLP in C, straight into the buffer the pipe's writer thread sends, so the exporter process has little
left to do: `api()` gives the functions of the recorder in use. RADIXMESH_TRACE_RECORDER=python keeps the Python one
(the same spans; slower, in the service and in its exporter).

What a span costs the serving process is counted in instructions by
`python -m radixmesh.benchmarks.router_instructions`: every operation here runs per request, so the code keeps to the
fewest attribute stores and calls (ids stay ints until a traceparent needs hex; a record is marshalled in its batch,
where the strings and ids it shares with the others, such as attribute names and its trace's id, are written once).

Attribute names are stored as the call sites give them: bare names get their `radixmesh.` prefix and None values
are dropped in the exporter process (trace_export.add_attributes), off the serving process's CPU."""

from __future__ import annotations

import os
import traceback
from contextvars import ContextVar
from marshal import dumps
from random import getrandbits
from time import time_ns
from typing import Any, Callable, NamedTuple

from radixmesh.services.common.trace_context import LOW64, RemoteContext, Sampler, traceparent

INTERNAL, SERVER, CLIENT = 1, 2, 3  # OTLP Span.SpanKind values
# Batches are marshalled with references (version >= 3): an object a batch holds more than once (an interned
# attribute name, a span name, a trace id its spans share) is written once.
MARSHAL_VERSION = 4
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
    # spans that ended before this one and never were current (`Child`), as (span_id, name, kind, start_ns, end_ns,
    # attributes, events, status) each: children of this span, sent inside its record (`expand` makes them Records)
    children: list | None = None


CURRENT: ContextVar["Span | Remote | None"] = ContextVar("radixmesh_span", default=None)
# The native recorder (services/common/_spanrec.c), where it is built and not turned off
native = None
if os.environ.get("RADIXMESH_TRACE_RECORDER", "native").strip().lower() != "python":
    try:
        from radixmesh.services.common import _spanrec as native
    except ImportError:
        native = None
if native is not None:
    traceparent = native.traceparent  # noqa: F811 - the same header, formatted in C
# The sampler, unpacked: new spans are decided inline (a call per span costs more than the decision itself)
_parent_based, _bound = True, 1 << 64
_sink: Callable[[tuple], None] = lambda record: None  # noqa: E731


def configure(sampler: Sampler, sink: Callable[[tuple], None]) -> None:
    """Where finished spans go (Record tuples) and how new ones are sampled (tracing.setup_tracing). With the native
    recorder, `native.add` as the sink writes every record into its buffer (trace_pipe.SpanPipe sends it)."""
    global _parent_based, _bound, _sink
    _parent_based, _bound, _sink = sampler.parent_based, sampler.bound, sink
    if native is not None:
        native.configure(CURRENT, sampler.bound, finish_error, close_call, leaf, _attributes,
                         None if sink is native.add else sink)


def api() -> tuple:
    """(new root, the Root type, open_call, close_call, leaf, call_traceparent) of the recorder in use: the native
    one where it is built, else this module's."""
    if native is not None:
        return native.root, native.Root, native.open_call, native.close_call, native.leaf, native.call_traceparent
    return Root, Root, open_call, close_call, leaf, call_traceparent


def call_traceparent(opened: tuple) -> str:
    """The W3C traceparent of an `open_call`."""
    p, span_id, _ = opened
    return traceparent(p.trace_id, span_id, p.sampled)


def _new_id(bits: int) -> int:
    value = getrandbits(bits)
    while not value:  # an all-zero id is invalid in W3C trace context
        value = getrandbits(bits)
    return value


def _exception_event(exc: BaseException) -> tuple:
    """(name, time ns, attributes) of the `exception` event for `exc` (OpenTelemetry's semantic conventions)."""
    module, qualname = type(exc).__module__, type(exc).__qualname__
    return ("exception", time_ns(), {
        "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
        "exception.message": str(exc),
        "exception.stacktrace": "".join(traceback.format_exception(exc)),
        "exception.escaped": "False"})


class Remote:
    """A caller's span as its traceparent describes it (kind 0, never recorded): the parent of this process's first
    span of the trace, and current inside `tracing.attached`."""

    __slots__ = ("trace_id", "span_id", "sampled", "tracestate", "baggage")
    kind = 0
    recording = False  # nothing of this process is recorded in it: a leaf under it is sent on its own
    parent = None
    name = ""
    origin = property(lambda self: self)

    def __init__(self, ctx: RemoteContext):
        self.trace_id, self.span_id, self.sampled, self.tracestate, self.baggage = ctx

    def traceparent(self) -> str:
        return traceparent(self.trace_id, self.span_id, self.sampled)

    @property
    def trace_id_hex(self) -> str:
        return f"{self.trace_id:032x}"


class Span:
    """One span. `with span:` makes it current inside and ends it (an escaping Exception marks it failed, as the
    OpenTelemetry SDK does); otherwise end it with `end()`. Methods modify the span in place; on a span that is not
    sampled they change nothing that is exported."""

    __slots__ = ("name", "kind", "attributes", "parent", "origin", "trace_id", "span_id", "sampled", "recording",
                 "start_ns", "events", "status", "children", "_token")

    def __init__(self, name: str, kind: int, attributes: dict, parent: "Span | Remote | None", start_ns: int = 0):
        self.name = name
        self.kind = kind
        self.attributes = attributes
        self.parent = parent
        self.span_id = getrandbits(64) or _new_id(64)
        if parent is None:
            self.origin = None
            self.trace_id = trace_id = getrandbits(128) or _new_id(128)
            self.sampled = self.recording = (trace_id & LOW64) < _bound
        else:
            self.origin = parent.origin  # the caller's span this trace came from (tracestate, baggage), or None
            self.trace_id = trace_id = parent.trace_id
            self.sampled = self.recording = parent.sampled if _parent_based else (trace_id & LOW64) < _bound
        self.start_ns = start_ns or time_ns()
        self.events = self.status = self.children = None

    @staticmethod
    def remote(ctx: RemoteContext) -> Remote:
        """A stand-in for a caller's span, the parent of this process's first span."""
        return Remote(ctx)

    @property
    def tracestate(self) -> str:
        """The trace's W3C tracestate, as the caller's traceparent came with it ("" for a trace begun here)."""
        o = self.origin
        return "" if o is None else o.tracestate

    @property
    def baggage(self) -> str:
        o = self.origin
        return "" if o is None else o.baggage

    def __enter__(self) -> "Span":
        self._token = CURRENT.set(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            CURRENT.reset(self._token)
        except ValueError:  # left in another context than it was entered in (a generator closed elsewhere)
            pass
        if self.recording:
            if exc is not None and isinstance(exc, Exception):
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
        if self.recording:
            name, at, attributes = _exception_event(exc)
            self.add_event(name, attributes, at)

    def is_recording(self) -> bool:
        return self.recording

    def end(self, end_ns: int | None = None) -> None:
        """Finish the span (once; later calls do nothing) and hand it to the sink if it is sampled."""
        if self.recording:
            self.recording = False
            p = self.parent
            if p is None:
                _sink((self.trace_id, self.span_id, 0, False, self.name, self.kind, self.start_ns,
                       end_ns or time_ns(), self.attributes, self.events, self.status, "", self.children))
            else:
                _sink((self.trace_id, self.span_id, p.span_id, p.kind == 0, self.name, self.kind, self.start_ns,
                       end_ns or time_ns(), self.attributes, self.events, self.status, p.tracestate, self.children))

    def finish(self, name: str, names: tuple, values: tuple, error: BaseException | str | None = None) -> None:
        """Root.finish for a span made current by `begin` (a server span under a caller's traceparent)."""
        try:
            CURRENT.reset(self._token)
        except (ValueError, RuntimeError):
            pass
        if self.recording:
            if error is not None:
                finish_error(self, error)
            self.name = name
            self.attributes.update(zip(names, values))
            self.end()

    def begin(self) -> "Span":
        """Make the span current until `finish` (the form of a server span that ends elsewhere than it began)."""
        self._token = CURRENT.set(self)
        return self

    @property
    def trace_id_hex(self) -> str:
        return f"{self.trace_id:032x}"

    def traceparent(self) -> str:
        return traceparent(self.trace_id, self.span_id, self.sampled)


class Root:
    """The server span of a request whose trace begins here (no caller's traceparent): what the router makes per
    HTTP request. Its attributes are given at its end, as values under a constant tuple of names (`finish`), its
    children go into its record as a Span's do, and it holds no state it does not need (no parent, origin or
    tracestate: those are class constants), so making and ending it costs about two thirds of what a Span costs
    through root_span (one request's calls replayed under callgrind: 11.7k instructions against 17.0k).
    Attributes set on it while it is open (`set_attribute`) go into a dict made for the first of them, sent beside
    the values."""

    __slots__ = ("trace_id", "span_id", "sampled", "recording", "start_ns", "attributes", "events", "status",
                 "children", "_token")
    kind = SERVER
    parent = origin = None
    tracestate = baggage = ""

    def __init__(self):
        """A new trace's root span, made current (until `finish`)."""
        self.span_id = getrandbits(64) or _new_id(64)
        self.trace_id = trace_id = getrandbits(128) or _new_id(128)
        self.sampled = self.recording = (trace_id & LOW64) < _bound
        self.start_ns = time_ns()
        self.attributes = self.events = self.status = self.children = None
        self._token = CURRENT.set(self)

    def set_attribute(self, key: str, value: Any) -> None:
        if self.attributes is None:
            self.attributes = {key: value}
        else:
            self.attributes[key] = value

    def set_attributes(self, attributes: dict) -> None:
        if self.attributes is None:
            self.attributes = dict(attributes)
        else:
            self.attributes.update(attributes)

    add_event, set_error, record_exception, is_recording = (Span.add_event, Span.set_error, Span.record_exception,
                                                            Span.is_recording)
    trace_id_hex, traceparent = Span.trace_id_hex, Span.traceparent

    def finish(self, name: str, names: tuple, values: tuple, error: BaseException | str | None = None) -> None:
        """End the span (once; later calls do nothing), restore the span current before it, and hand it to the sink
        if it is sampled: named `name`, with attributes `values` under `names` (and those set while it was open);
        `error` as `finish_error` takes it."""
        try:
            CURRENT.reset(self._token)
        except (ValueError, RuntimeError):  # ended in another context than it began in, or a second time
            pass
        if self.recording:
            if error is not None:
                finish_error(self, error)
            self.recording = False
            _sink((self.trace_id, self.span_id, 0, False, name, SERVER, self.start_ns, time_ns(),
                   (names, values) if self.attributes is None else (names, values, self.attributes), self.events,
                   self.status, "", self.children))


def finish_error(s: "Span | Root", error: BaseException | str) -> None:
    """Mark a span that ends with `error`: an Exception (recorded as an event; the span failed), a description of a
    failure (the span failed), or a cancellation (marked `cancelled`)."""
    if isinstance(error, str):
        s.set_error(error)
    elif isinstance(error, Exception):
        s.record_exception(error)
        s.set_error(f"{type(error).__name__}: {error}")
    else:
        s.set_attribute("radixmesh.cancelled", True)


if native is not None:  # what the native Root does not do in C: the rarer calls, as Root has them
    native.Root.kind, native.Root.parent, native.Root.origin = SERVER, None, None
    native.Root.tracestate = native.Root.baggage = ""
    for _name in ("set_attributes", "add_event", "set_error", "record_exception", "is_recording"):
        setattr(native.Root, _name, getattr(Root, _name))


class Child:
    """A span that is never made current (tracing.start_span: a call, a routing decision), child of a local span. It
    costs less than a Span: no trace or sampling state of its own (its parent's), and when it ends while its parent
    is still open it goes into the parent's record as one short entry instead of a record of its own (a parent that
    ended first does not wait for it: then it is sent as its own record)."""

    __slots__ = ("parent", "name", "kind", "attributes", "span_id", "start_ns", "events", "status", "recording")

    def __init__(self, name: str, kind: int, attributes: dict, parent: Span):
        self.parent = parent
        self.name = name
        self.kind = kind
        self.attributes = attributes
        self.span_id = getrandbits(64) or _new_id(64)
        self.recording = parent.sampled
        self.start_ns = time_ns()
        self.events = self.status = None

    trace_id = property(lambda self: self.parent.trace_id)
    sampled = property(lambda self: self.parent.sampled)
    origin = property(lambda self: self.parent.origin)
    tracestate, baggage = Span.tracestate, Span.baggage
    trace_id_hex = property(lambda self: self.parent.trace_id_hex)
    set_attribute, set_attributes, add_event = Span.set_attribute, Span.set_attributes, Span.add_event
    set_error, record_exception, is_recording = Span.set_error, Span.record_exception, Span.is_recording

    def traceparent(self) -> str:
        return traceparent(self.parent.trace_id, self.span_id, self.parent.sampled)

    def end(self, end_ns: int | None = None) -> None:
        """Finish the span (once): into its parent's record while the parent is open, else to the sink."""
        if self.recording:
            self.recording = False
            p = self.parent
            if p.recording:
                entry = (self.span_id, self.name, self.kind, self.start_ns, end_ns or time_ns(), self.attributes,
                         self.events, self.status)
                if p.children is None:
                    p.children = [entry]
                else:
                    p.children.append(entry)
            else:
                _sink((p.trace_id, self.span_id, p.span_id, False, self.name, self.kind, self.start_ns,
                       end_ns or time_ns(), self.attributes, self.events, self.status, p.tracestate, None))


def expand(records: list[tuple]) -> list[tuple]:
    """Records as the exporter reads them: children sent inside their parents' records made Records of their own
    (12 fields each, the `children` field left out), positional attributes ((names, values), from `leaf` and
    `close_call`) made dicts, and children sent without a span id (leaves) given one."""
    out = []
    for r in records:
        out.append(r[:8] + (_attributes(r[8]),) + r[9:12])
        if r[12]:
            trace_id, parent_id, tracestate = r[0], r[1], r[11]
            out += [(trace_id, span_id or _new_id(64), parent_id, False, name, kind, start, end, _attributes(attrs),
                     events, status, tracestate)
                    for span_id, name, kind, start, end, attrs, events, status in r[12]]
    return out


def _attributes(attrs: dict | tuple) -> dict:
    """A record's attributes as a dict: given as one, or as (names, values) or (names, values, a dict of more)."""
    if type(attrs) is not tuple:
        return attrs
    out = dict(zip(attrs[0], attrs[1]))
    if len(attrs) > 2:
        out.update(attrs[2])
    return out


def open_call() -> tuple | None:
    """The start of a client span whose context goes with a call (tracing.put_context / metadata_for take it) and
    that is never made current: (parent, span id, start ns), or None when no span is current. Cheaper than a
    `Child` (no object); end it with `close_call`, which names it."""
    p = CURRENT.get()
    if p is None:
        return None
    return (p, getrandbits(64) or _new_id(64), time_ns())


def close_call(opened: tuple, name: str, kind: int, names: tuple, values: tuple,
               error: BaseException | None = None) -> None:
    """End a span from `open_call`: its attributes are `values` under `names` (bare names get `radixmesh.` in the
    exporter, None values are dropped there); `error` as tracing.end_span takes it."""
    p, span_id, start = opened
    if error is None and p.recording:  # the common case, inline: into the open parent's record
        if p.children is None:
            p.children = [(span_id, name, kind, start, time_ns(), (names, values), None, None)]
        else:
            p.children.append((span_id, name, kind, start, time_ns(), (names, values), None, None))
    elif p.sampled:
        _leaf(p, span_id, name, kind, start, names, values, error)


def leaf(name: str, kind: int, start_ns: int, names: tuple, values: tuple, error: BaseException | None = None
         ) -> None:
    """A finished child of the current span that began at `start_ns` (time_ns) and ends now, never made current and
    with no context sent anywhere (a routing decision): attributes as in `close_call`, its span id given by the
    exporter. Nothing happens without a current sampled span."""
    p = CURRENT.get()
    if p is None:
        return
    if error is None and p.recording:  # as in close_call
        if p.children is None:
            p.children = [(0, name, kind, start_ns, time_ns(), (names, values), None, None)]
        else:
            p.children.append((0, name, kind, start_ns, time_ns(), (names, values), None, None))
    elif p.sampled:
        _leaf(p, 0, name, kind, start_ns, names, values, error)


def _leaf(p, span_id: int, name: str, kind: int, start: int, names: tuple, values: tuple,
          error: BaseException | None) -> None:
    events = status = None
    if error is not None:
        if isinstance(error, Exception):
            events = [_exception_event(error)]
            status = (STATUS_ERROR, str(error) or type(error).__name__)
        else:  # a cancellation
            names, values = names + ("cancelled",), values + (True,)
    if p.recording:  # the parent is open: into its record
        entry = (span_id, name, kind, start, time_ns(), (names, values), events, status)
        if p.children is None:
            p.children = [entry]
        else:
            p.children.append(entry)
    else:
        _sink((p.trace_id, span_id or _new_id(64), p.span_id, p.kind == 0, name, kind, start, time_ns(),
               (names, values), events, status, p.tracestate, None))


def encode_batch(records: list[tuple]) -> bytes:
    """Finished spans as the exporter reads them: the list of Record tuples, marshalled (with references). A record
    holding a value marshal does not write goes as its `plain` copy."""
    try:
        return dumps(records, MARSHAL_VERSION)
    except ValueError:
        return dumps([plain(r) for r in records], MARSHAL_VERSION)


def plain(record: tuple) -> tuple:
    """`record` with attribute values marshal can write (others as their str()), its children's too."""
    r = Record(*record)
    children = [(span_id, name, kind, start, end, _plain_attributes(attrs), _plain_events(events), status)
                for span_id, name, kind, start, end, attrs, events, status in r.children or ()]
    return tuple(r._replace(attributes=_plain_attributes(r.attributes), events=_plain_events(r.events),
                            children=children or None))


def _plain_attributes(attributes: dict | tuple) -> dict:
    return {k: _plain_value(v) for k, v in _attributes(attributes).items()}


def _plain_events(events: list | None) -> list | None:
    return [(name, at, _plain_attributes(attrs)) for name, at, attrs in events] if events else None


def _plain_value(v: Any) -> Any:
    if v is None or isinstance(v, (str, bool, int, float, bytes)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (str, bool, int, float)) for x in v):
        return list(v)
    return str(v)
