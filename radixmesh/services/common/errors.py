"""Exceptions raised inside servicers become gRPC status codes with their message; the service keeps serving.

ValueError -> INVALID_ARGUMENT (bad input), TimeoutError -> DEADLINE_EXCEEDED, RuntimeError from a dead or
overloaded engine -> UNAVAILABLE, Exhausted -> RESOURCE_EXHAUSTED, anything else -> INTERNAL (logged with its
traceback). An error after the caller went away (cancelled, past its deadline) is logged as that and answered with
nothing: there is no one to answer."""

from __future__ import annotations

import asyncio
import logging

import grpc

from radixmesh.services.common.logs import request_id_var

log = logging.getLogger(__name__)


class Unavailable(RuntimeError):
    """The service cannot take the call now (shutting down, no healthy peer); callers may retry elsewhere."""


class Exhausted(Exception):
    """The service is full for now (a bounded queue); callers get RESOURCE_EXHAUSTED."""


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a grpc.aio call raises, for a call-like object that is not one (a GenerateStream request of the
    router's mux, a stream lane) to fail with."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, Exhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, (Unavailable, ConnectionError)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, RuntimeError) and "engine" in str(exc):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def _request_id(request, context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id":
            return value
    return getattr(request, "request_id", "") or "-"


try:  # what a write raises once the call is over (grpc's own class; nothing matches if it ever moves)
    from grpc._cython.cygrpc import ExecuteBatchError as _WRITE_AFTER_END
except ImportError:  # pragma: no cover
    _WRITE_AFTER_END = ()


def _caller_gone(exc: Exception, context: grpc.aio.ServicerContext) -> bool:
    """Whether the call is over from the caller's side (it cancelled, or its deadline passed): gRPC cancelled this
    handler's task, or the answer can no longer be written. There is no one to send a status to."""
    task = asyncio.current_task()
    return (context.done() or (task is not None and task.cancelling() > 0)
            or isinstance(exc, _WRITE_AFTER_END))


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext) -> None:
    if _caller_gone(exc, context):
        log.info("the call ended before its answer (%s: %s)", type(exc).__name__, exc)
        return
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("internal error")
    else:
        log.info("%s: %s", code.name, exc)
    await context.abort(code, str(exc) or type(exc).__name__)


def _wrap_unary(fn):
    async def handler(request, context):
        request_id_var.set(_request_id(request, context))
        try:
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every error becomes a status, none kills the server
            await _abort_for(e, context)
    return handler


def _wrap_stream(fn):
    async def handler(request, context):
        request_id_var.set(_request_id(request, context))
        try:
            async for item in fn(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001
            await _abort_for(e, context)
    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions to status codes and sets the logging request id, for unary and server-streaming RPCs."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary),
                                                       handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream),
                                                        handler.request_deserializer, handler.response_serializer)
        return handler
