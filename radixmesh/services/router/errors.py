"""How the router fails a request: RouterError carries the HTTP status, status_of maps a worker's gRPC status to one.
Its own module so that the request paths (core, pd) share it without importing each other."""

from __future__ import annotations

import grpc

_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
           grpc.StatusCode.RESOURCE_EXHAUSTED: 503, grpc.StatusCode.UNAVAILABLE: 503,
           grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.UNIMPLEMENTED: 501,
           grpc.StatusCode.ABORTED: 503}


def status_of(code: grpc.StatusCode) -> int:
    """The HTTP status for a worker's gRPC status."""
    return _STATUS.get(code, 500)


class RouterError(Exception):
    """A failed request: `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message
