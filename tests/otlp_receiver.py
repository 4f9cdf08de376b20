"""A real OTLP/gRPC trace endpoint for tests: a grpc server implementing
opentelemetry.proto.collector.trace.v1.TraceService/Export on a free loopback port, keeping every span it receives
with the service.name of the process that sent it."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root
    kind: int
    attributes: dict
    events: tuple[str, ...]
    start_ns: int
    end_ns: int
    status: int = 0  # the OTLP status code: 0 unset, 1 ok, 2 error


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else str(v)


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: "OtlpReceiver"):
        self.sink = sink

    def Export(self, request, context):
        spans = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "?")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                              s.kind, {a.key: _value(a.value) for a in s.attributes},
                                              tuple(e.name for e in s.events), s.start_time_unix_nano,
                                              s.end_time_unix_nano, s.status.code))
        self.sink.add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def add(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self.spans.extend(spans)
            self.exports += 1

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 30.0) -> list[ReceivedSpan]:
        """The spans of `trace_id` once every name in `names` arrived (and a moment more for stragglers)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if names <= {s.name for s in self.trace(trace_id)}:
                time.sleep(1.0)
                return self.trace(trace_id)
            time.sleep(0.2)
        return self.trace(trace_id)

    def close(self) -> None:
        self.server.stop(grace=None)
