"""The worker side of WorkerService.GenerateStream: many requests over one stream. `serve(requests, context, generate)`
runs each submitted request through `generate(request, context, emit)` (what the servicer's Generate runs too: the
same validation, engine path and metrics) as a task of its own; `emit` puts each response in the outbox as the engine
delivers it, and whatever is ready together goes as ONE response message: the outputs of all of a scheduler step's
requests reach the router in one gRPC message, instead of one per request per token. An `abort` cancels its request's
task (the engine aborts it and frees its KV pages); the stream closing cancels them all. Errors end a request with
the status a Generate call would have got. A request with a trace context gets the server span a traced Generate call
would get."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Callable

import grpc

from radixmesh.v1 import worker_pb2
from radixmesh.services.common import tracing
from radixmesh.services.common.errors import status_for
from radixmesh.services.common.logs import request_id_var

log = logging.getLogger(__name__)
GENERATE = "radixmesh.v1.WorkerService/Generate"
SPAN_ATTRIBUTES = {"rpc.system": "grpc", "rpc.service": "radixmesh.v1.WorkerService", "rpc.method": "Generate"}


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class RequestContext:
    """What Generate uses of a ServicerContext, for one request of a stream."""

    def __init__(self, stream_context: grpc.aio.ServicerContext):
        self._stream = stream_context

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)

    def invocation_metadata(self):
        return self._stream.invocation_metadata()

    def is_active(self) -> bool:
        return True

    def peer(self) -> str:
        return self._stream.peer()


async def messages(generate: Callable, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                   ) -> AsyncIterator[worker_pb2.GenerateResponse]:
    """A call per request (Generate): what `generate(request, context, emit)` emits, yielded as it comes; its error,
    if any, is the call's. The caller leaving cancels it."""
    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(generate(request, context, queue.put_nowait))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while (msg := await queue.get()) is not None:
            yield msg
        await task
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def serve(requests: AsyncIterator[worker_pb2.GenerateStreamRequest], context: grpc.aio.ServicerContext,
                generate: Callable, draining: asyncio.Event | None = None
                ) -> AsyncIterator[worker_pb2.GenerateStreamResponse]:
    """`draining` (GrpcService.draining): once set, new submits are refused with UNAVAILABLE (the router retries
    them elsewhere) and the stream ends when its running requests have finished, so the server's drain is not held
    for its whole grace period by a stream that would never end."""
    outbox: list[worker_pb2.GenerateResponse] = []
    ended: list[worker_pb2.GenerateEnd] = []
    wake = asyncio.Event()
    tasks: dict[str, asyncio.Task] = {}
    reading = True

    def emit(msg: worker_pb2.GenerateResponse) -> None:
        outbox.append(msg)
        wake.set()

    async def run(request: worker_pb2.GenerateRequest) -> None:
        rid = request.request_id
        request_id_var.set(rid or "-")
        code, details = grpc.StatusCode.OK, ""
        # the server span a Generate call with this trace context would get (services/common/trace_grpc.py)
        carried = tracing.carried_context(request)
        span = contextlib.nullcontext() if carried is None else tracing.root_span(GENERATE, carried, **SPAN_ATTRIBUTES)
        try:
            with span:
                await generate(request, RequestContext(context), emit)
        except asyncio.CancelledError:
            return  # aborted by the router, or the stream closed: nobody waits for an answer
        except _Aborted as e:
            code, details = e.code, e.details
        except Exception as e:  # noqa: BLE001 - the request's status, as the error interceptor would give it
            code, details = status_for(e), str(e) or type(e).__name__
            if code is grpc.StatusCode.INTERNAL:
                log.exception("internal error")
            else:
                log.info("%s: %s", code.name, details)
        finally:
            if tasks.get(rid) is asyncio.current_task():
                del tasks[rid]
        ended.append(worker_pb2.GenerateEnd(request_id=rid, code=code.value[0], message=details))
        wake.set()

    async def read() -> None:
        nonlocal reading
        try:
            async for req in requests:
                action = req.WhichOneof("action")
                if action == "submit":
                    rid = req.submit.request_id
                    if draining is not None and draining.is_set():
                        ended.append(worker_pb2.GenerateEnd(request_id=rid, code=grpc.StatusCode.UNAVAILABLE.value[0],
                                                            message="the worker is shutting down"))
                    elif rid in tasks:
                        ended.append(worker_pb2.GenerateEnd(
                            request_id=rid, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                            message=f"request_id {rid!r} is already running on this stream"))
                    else:
                        tasks[rid] = asyncio.create_task(run(req.submit))
                elif action == "abort":
                    task = tasks.pop(req.abort, None)
                    if task is not None:
                        task.cancel()
                else:  # the handshake: answered with an empty message
                    pass
                wake.set()
        finally:
            reading = False
            wake.set()

    async def drain() -> None:
        await draining.wait()
        wake.set()

    reader = asyncio.create_task(read())
    drainer = asyncio.create_task(drain()) if draining is not None else None
    try:
        yield worker_pb2.GenerateStreamResponse()  # the handshake's answer: this worker speaks GenerateStream
        while (reading and not (draining is not None and draining.is_set())) or tasks or outbox or ended:
            await wake.wait()
            wake.clear()
            if outbox or ended:
                batch = worker_pb2.GenerateStreamResponse(responses=outbox, ended=ended)
                outbox, ended = [], []
                yield batch
            elif not reading and not tasks:
                break
    finally:
        reader.cancel()
        if drainer is not None:
            drainer.cancel()
        for task in list(tasks.values()):
            task.cancel()
