"""`python -m services.common.trace_export --role R --parent-pid P [--endpoint URL]`: a traced service's exporter
process (started by services.common.trace_pipe). It reads span batches from stdin (frames: a 4-byte little-endian
length, then a marshalled list of trace_recorder.Record tuples), encodes them as OTLP protobuf
(services.common.trace_otlp) and exports them to the collector with the OpenTelemetry OTLP/gRPC exporter, which applies the standard variables
(OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _HEADERS, _TIMEOUT, _COMPRESSION, _CERTIFICATE, _INSECURE) and retries.
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
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource as SdkResource

from services.common import trace_otlp, trace_recorder

log = logging.getLogger("services.common.trace_export")

SERVICE_PREFIX = "radixmesh-"  # service.name = radixmesh-<role> unless OTEL_SERVICE_NAME says otherwise
SCOPE = "radixmesh"
PARENT_POLL_S = 1.0
EXIT_GRACE_S = 3.0  # for the last exports once the service closed the pipe
_FRAME = struct.Struct("<I")


class _PrebuiltExporter(OTLPSpanExporter):
    """The SDK's OTLP/gRPC exporter (configuration, channel, retries) sending a request built here."""

    def _translate_data(self, data: ExportTraceServiceRequest) -> ExportTraceServiceRequest:
        return data

    def _count_data(self, data: ExportTraceServiceRequest) -> int:
        return sum(len(ss.spans) for rs in data.resource_spans for ss in rs.scope_spans)


def resource(role: str) -> bytes:
    """The SDK's resource for this role as an encoded Resource message (what the service's own SDK set-up made)."""
    attributes = {"radixmesh.role": role}
    if "OTEL_SERVICE_NAME" not in os.environ and "service.name=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes["service.name"] = SERVICE_PREFIX + role
    return trace_otlp.resource(dict(SdkResource.create(attributes).attributes))


def request(res: bytes, records: list[tuple]) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(trace_otlp.request(res, SCOPE, records))


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


def batches(fd: int, parent_pid: int) -> Iterator[list[tuple]]:
    """The span batches the service writes to `fd` (frames of marshalled records), until it closes it or exits."""
    while True:
        head = _read_exactly(fd, _FRAME.size, parent_pid)
        if head is None:
            return
        body = _read_exactly(fd, _FRAME.unpack(head)[0], parent_pid)
        if body is None:
            return
        yield trace_recorder.expand(marshal.loads(body))


def _export_all(exporter: OTLPSpanExporter, res: bytes, pending: queue.Queue, batch: int, failed: list) -> None:
    while (records := pending.get()) is not None:
        for i in range(0, len(records), batch):
            chunk = records[i:i + batch]
            if exporter.export(request(res, chunk)).name != "SUCCESS":
                failed[0] += len(chunk)


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
