"""W3C trace context over gRPC (grpc.aio), installed only while tracing is on (services.common.tracing); two small
interceptors of ours rather than opentelemetry-instrumentation-grpc, whose server interceptor starts a trace for
every call (health probes and load polls included) and whose client one adds a client span to every call:

- the client interceptors add the current sampled span's `traceparent` (and `tracestate`, baggage) to the metadata
  of every call made inside it; calls outside any sampled span (health probes, load polls) go out untouched. The
  router gets the unary-unary one only (for its admin calls: /health_generate, /get_server_info, /flush_cache): its
  per-request calls pass the context themselves (Generate: tracing.metadata_for; Tokenize, Detokenize and
  MatchPrefix: tracing.current_metadata, on channels without interceptors), because grpc.aio puts every call of
  an intercepted type on a slower path (a task per call, a wrapper per streamed message).
- `ServerTraceInterceptor` gives each call that arrives with a `traceparent` a server span named
  `<package.Service>/<Method>`, a child of the caller's, current while the handler runs (so the handler's own spans
  and log lines join the caller's trace). Calls without one get no span: a trace starts at a client request."""

from __future__ import annotations

import grpc

from radixmesh.services.common import tracing

TRACEPARENT = "traceparent"
EXPLICIT_ROLES = frozenset({"router"})  # roles whose streamed and per-request calls carry their context themselves


def client_interceptors() -> list:
    """The interceptors a channel gets: none while tracing is off."""
    if not tracing.enabled():
        return []
    if tracing.role() in EXPLICIT_ROLES:
        return [_UnaryUnary()]
    # grpc.aio files each interceptor under the first call type it implements: one object per type
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]


def server_interceptors() -> list:
    return [ServerTraceInterceptor()] if tracing.enabled() else []


def _with_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """The call's details with the current trace context added, unless the caller gave one (tracing.metadata_for)
    or no span is current."""
    if any(key == TRACEPARENT for key, _ in details.metadata or ()):
        return details
    carried = tracing.current_metadata()
    if not carried:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *carried)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_context(client_call_details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_context(client_call_details), request_iterator)


def _span(method: str, metadata):
    service, _, name = method.lstrip("/").partition("/")
    return tracing.root_span(method.lstrip("/"), dict(metadata),
                             **{"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})


def _unary(fn, method: str, metadata):
    async def handler(request, context):
        with _span(method, metadata):
            return await fn(request, context)
    return handler


def _streaming(fn, method: str, metadata):
    async def handler(request, context):
        with _span(method, metadata):
            async for item in fn(request, context):
                yield item
    return handler


class ServerTraceInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        if handler is None or not any(key == TRACEPARENT for key, _ in metadata):
            return handler
        method = handler_call_details.method
        args = (handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary, method, metadata), *args)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_unary(handler.stream_unary, method, metadata), *args)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_streaming(handler.unary_stream, method, metadata), *args)
        return grpc.stream_stream_rpc_method_handler(_streaming(handler.stream_stream, method, metadata), *args)
