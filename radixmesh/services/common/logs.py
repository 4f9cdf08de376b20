"""Logging for services: one line per record with the service name and the request id in flight (a contextvar set
by the gRPC interceptor or the HTTP handler), so a request can be followed across processes; with tracing on, also
the trace id of the current span (`[<request id> trace=<32 hex digits>]`)."""

from __future__ import annotations

import contextvars
import faulthandler
import logging
import signal
from typing import Callable

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
# Set by services.common.tracing while tracing is on: the current trace id, or "" outside any span.
trace_id_source: Callable[[], str] | None = None


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        trace_id = trace_id_source() if trace_id_source is not None else ""
        record.trace = f" trace={trace_id}" if trace_id else ""
        return True


def setup_logging(service: str, level: str = "info") -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {service} [%(request_id)s%(trace)s] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("asyncio").setLevel(logging.WARNING)
    try:  # `kill -USR1 <pid>`: every thread's stack on stderr
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (ValueError, OSError, AttributeError):  # stderr is no file (a test capturing it, say): no dumps
        pass
