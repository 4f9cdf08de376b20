"""`python -m radixmesh.services.common.trace_export --role R --parent-pid P [--endpoint URL]`: a traced service's
exporter process (started by services.common.trace_pipe). It reads span batches from stdin (frames: a 4-byte
little-endian length, then a marshalled list of trace_recorder.Record tuples, which it encodes as OTLP protobuf with
services.common.trace_otlp, or spans the native recorder already encoded) and exports them to the collector with
the OpenTelemetry OTLP/gRPC exporter, whose request it hands over as bytes; the exporter applies the standard variables
(OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS, _TIMEOUT, _COMPRESSION, _CERTIFICATE, _INSECURE) and retries. To a
cleartext collector the calls go over services.common.otlp_h2's own HTTP/2 connection rather than grpc's client
(about half of its CPU a call); RADIXMESH_OTLP_TRANSPORT=grpc keeps grpc's.
The resource is the SDK's (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, telemetry.sdk.*), with service.name
radixmesh-<role> unless those variables name the service.

It exits, after exporting what it has read, when stdin reaches its end (the service closed it or died) or when its
parent process is gone."""

from __future__ import annotations

import argparse
import logging
import marshal
import os
import queue
import select
import struct
import sys
import threading
from typing import Iterator

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource as SdkResource

from radixmesh.services.common import otlp_h2, trace_otlp, trace_recorder
from radixmesh.services.common.trace_pipe import OTLP_FRAME

log = logging.getLogger("radixmesh.services.common.trace_export")

SERVICE_PREFIX = "radixmesh-"  # service.name = radixmesh-<role> unless OTEL_SERVICE_NAME says otherwise
SCOPE = "radixmesh"
PARENT_POLL_S = 1.0
EXIT_GRACE_S = 3.0  # for the last exports once the service closed the pipe
_FRAME = struct.Struct("<I")
_COUNT = struct.Struct("<i")
TRANSPORT_VAR = "RADIXMESH_OTLP_TRANSPORT"  # "grpc": grpc's client even where otlp_h2 could carry the calls
_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class Encoded:
    """An ExportTraceServiceRequest already encoded, of `count` spans: what the exporter sends. `parts`: buffers
    whose bytes in order are the request (its head, then the spans where they were read: otlp_h2 sends them as they
    lie); `payload`: the request as one bytes (grpc's client wants that)."""

    __slots__ = ("parts", "count")

    def __init__(self, payload, count: int):
        self.parts = (payload,) if isinstance(payload, (bytes, memoryview)) else tuple(payload)
        self.count = count

    @property
    def payload(self) -> bytes:
        return self.parts[0] if len(self.parts) == 1 and type(self.parts[0]) is bytes else b"".join(self.parts)


class _BytesStub:
    """TraceService's stub, sending an Encoded request's bytes as they are (no message built, nothing re-encoded)."""

    def __init__(self, channel):
        self.Export = channel.unary_unary(_EXPORT, request_serializer=lambda request: request.payload,
                                          response_deserializer=ExportTraceServiceResponse.FromString)


class _LeanStub:
    """TraceService's stub over services.common.otlp_h2's connection: the same call, a fraction of grpc's CPU."""

    def __init__(self, connection: otlp_h2.Connection, compression):
        self.connection, self.compression = connection, compression

    def Export(self, request: "Encoded", metadata=(), timeout: float = 10.0) -> None:
        self.connection.unary(_EXPORT, request.parts, metadata, timeout, self.compression)


class _PrebuiltExporter(OTLPSpanExporter):
    """The SDK's OTLP/gRPC exporter (configuration, retries and back-off, compression) sending a request encoded
    here: over services.common.otlp_h2 to a cleartext host:port collector (unless RADIXMESH_OTLP_TRANSPORT=grpc),
    over grpc's channel to anything else (TLS, unix sockets, named targets)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        target = otlp_h2.split_endpoint(self._endpoint) if self._insecure else None
        self.lean = None
        if target is not None and os.environ.get(TRANSPORT_VAR, "lean").strip().lower() != "grpc":
            self.lean = otlp_h2.Connection(*target)
            self._stub = lambda channel: _LeanStub(self.lean, self._compression)
        else:
            self._stub = _BytesStub  # also what a reconnection makes (_initialize_channel_and_stub)
        self._client = self._stub(self._channel)

    def shutdown(self, *args, **kwargs) -> None:
        super().shutdown(*args, **kwargs)
        if self.lean is not None:
            self.lean.close()

    def _translate_data(self, data: Encoded) -> Encoded:
        return data

    def _count_data(self, data: Encoded) -> int:
        return data.count


def resource(role: str) -> bytes:
    """The SDK's resource for this role as an encoded Resource message (what the service's own SDK set-up made)."""
    attributes = {"radixmesh.role": role}
    if "OTEL_SERVICE_NAME" not in os.environ and "service.name=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes["service.name"] = SERVICE_PREFIX + role
    return trace_otlp.resource(dict(SdkResource.create(attributes).attributes))


def requests(res: bytes, batch, most: int) -> list[Encoded]:
    """The export requests of one batch read from the service (a list of records, or (spans, count) already
    encoded), `most` spans each at most."""
    if type(batch) is list:
        return [Encoded(trace_otlp.request(res, SCOPE, batch[i:i + most]), len(batch[i:i + most]))
                for i in range(0, len(batch), most)]
    span_fields, count = batch
    runs = [(span_fields, count)] if count <= most else trace_otlp.split_spans(span_fields, most)
    return [Encoded((trace_otlp.request_head(res, SCOPE, len(run)), run), n) for run, n in runs]


def _read_exactly(fd: int, n: int, parent_pid: int) -> bytes | None:
    """`n` bytes from `fd`; None at the end of the stream or once the parent process is gone."""
    chunks, left = [], n
    while left:
        ready, _, _ = select.select([fd], [], [], PARENT_POLL_S)
        if not ready:
            if os.getppid() != parent_pid:
                return None
            continue
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def batches(fd: int, parent_pid: int) -> Iterator[list[tuple] | tuple[memoryview, int]]:
    """The span batches the service writes to `fd`, until it closes it or exits: a frame of marshalled records as
    their list (Records), a frame of the native recorder's as (its spans' encoding, their count)."""
    while True:
        head = _read_exactly(fd, _FRAME.size, parent_pid)
        if head is None:
            return
        body = _read_exactly(fd, _FRAME.unpack(head)[0], parent_pid)
        if body is None:
            return
        if body[:1] == OTLP_FRAME:  # the spans as a view of the frame read (not copied)
            yield memoryview(body)[5:], _COUNT.unpack_from(body, 1)[0]
        else:
            yield trace_recorder.expand(marshal.loads(body))


def _export_all(exporter: OTLPSpanExporter, res: bytes, pending: queue.Queue, batch: int, failed: list) -> None:
    while (read := pending.get()) is not None:
        for request in requests(res, read, batch):
            if exporter.export(request).name != "SUCCESS":
                failed[0] += request.count


def serve(fd: int, role: str, parent_pid: int, endpoint: str | None, batch: int) -> int:
    """Export every batch read from `fd` (on a thread of its own, so a slow export holds up reading by at most
    two batches, then the pipe fills and the service drops spans); returns how many the collector did not take.
    At the end of the stream the last exports get EXIT_GRACE_S, then retries still waiting are abandoned."""
    exporter = _PrebuiltExporter(endpoint=endpoint)
    pending: queue.Queue = queue.Queue(maxsize=2)
    failed = [0]
    worker = threading.Thread(target=_export_all, args=(exporter, resource(role), pending, batch, failed),
                              name="otlp-export", daemon=True)
    worker.start()
    for records in batches(fd, parent_pid):
        pending.put(records)
    try:
        pending.put(None, timeout=EXIT_GRACE_S)
        worker.join(EXIT_GRACE_S)
    except queue.Full:
        pass
    exporter.shutdown()  # ends a retry's back-off at once
    worker.join(1.0)
    return failed[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--endpoint", help="the collector (default: the OTEL_EXPORTER_OTLP_* variables)")
    p.add_argument("--batch", type=int, default=512, help="spans per export request at most")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s {args.role} trace-exporter "
                        "%(name)s: %(message)s")
    # a service that ended before this process got going still left its spans in the pipe: they are read (to its
    # end, or until nothing comes and the parent is gone) and exported like any others
    failed = serve(sys.stdin.fileno(), args.role, args.parent_pid, args.endpoint, max(args.batch, 1))
    if failed:
        log.warning("%d spans were not accepted by the collector", failed)


if __name__ == "__main__":
    main()
