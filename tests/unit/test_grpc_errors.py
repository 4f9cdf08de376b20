"""The services' error interceptor (services/common/errors.py) on a real gRPC server: a handler's error becomes the
status a caller reads; a handler that fails after its caller went away (a cancelled stream: the router dropping a
PD pair whose prefill failed) is logged as that, quietly, not as an internal error with a second failure from
aborting a finished call."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from radixmesh.services.common.errors import ErrorInterceptor

METHOD = "/test.Errors/Stream"


def _server(failed: asyncio.Event, waiting: asyncio.Event) -> grpc.aio.Server:
    async def stream(request: bytes, context):
        yield b"first"
        if request == b"fail-now":
            raise ValueError("bad input")
        try:
            waiting.set()
            await asyncio.sleep(60)  # the caller cancels meanwhile
        except asyncio.CancelledError:  # a handler that turns that into its own error, as the PD handoff does
            failed.set()
            raise RuntimeError("the handoff failed") from None

    handler = grpc.method_handlers_generic_handler("test.Errors", {"Stream": grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=bytes, response_serializer=bytes)})
    server = grpc.aio.server(interceptors=[ErrorInterceptor()])
    server.add_generic_rpc_handlers((handler,))
    return server


@pytest.mark.timeout(30)
def test_an_error_after_the_caller_went_away_is_not_an_internal_error(caplog):
    async def run():
        failed, waiting = asyncio.Event(), asyncio.Event()
        server = _server(failed, waiting)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_stream(METHOD, request_serializer=bytes, response_deserializer=bytes)(b"fail-now")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in call:
                        pass
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad input" in e.value.details()

                call = ch.unary_stream(METHOD, request_serializer=bytes, response_deserializer=bytes)(b"wait")
                assert await call.read() == b"first"
                # cancelled only once the handler waits: a cancel that finds it still at its yield closes the
                # generator there (GeneratorExit, not CancelledError), and the handler never fails (a loaded CI run)
                await asyncio.wait_for(waiting.wait(), 10)
                call.cancel()
                await asyncio.wait_for(failed.wait(), 10)
                await asyncio.sleep(0.3)  # the interceptor handles the error
        finally:
            await server.stop(None)

    with caplog.at_level(logging.INFO):
        asyncio.run(run())
    text = caplog.text
    assert "the call ended before its answer (RuntimeError: the handoff failed)" in text
    assert "internal error" not in text and "Abort already called" not in text
