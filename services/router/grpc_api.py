"""The router's public gRPC API (radixmesh.v1.RouterService): text or token ids in, the worker's stream out."""

from __future__ import annotations

import contextlib

import grpc

from radixmesh.v1 import router_pb2, router_pb2_grpc, tokenizer_pb2, worker_pb2
from services.router.core import Router, RouterError, new_request_id

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND, 501: grpc.StatusCode.UNIMPLEMENTED,
          503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request: router_pb2.RouterServiceGenerateRequest, context: grpc.aio.ServicerContext):
        if request.model and request.model != self.router.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not served here; "
                                f"serving {self.router.model_name!r}")
        rid = request.request_id or new_request_id()
        try:
            which = request.WhichOneof("input")
            if which == "text":
                tokenized = await self.router.tokenize(tokenizer_pb2.TokenizeRequest(text=request.text))
                ids = list(tokenized.input_ids)
            elif which == "input_ids" and request.input_ids.ids:
                ids = list(request.input_ids.ids)
            else:
                raise RouterError(400, "give text or input_ids")
            worker_request = worker_pb2.GenerateRequest(
                request_id=rid, input_ids=ids, text=request.text, sampling_params=request.sampling_params,
                logprob_options=request.logprob_options, stream=request.stream)
            async with contextlib.aclosing(self.router.generate(worker_request)) as messages:
                async for msg in messages:
                    kind = msg.WhichOneof("response")
                    if kind == "error":
                        raise RouterError(msg.error.http_status_code or 500, msg.error.message)
                    out = router_pb2.RouterServiceGenerateResponse(request_id=rid, index=msg.index)
                    getattr(out, kind).CopyFrom(getattr(msg, kind))
                    yield out
        except RouterError as e:
            await context.abort(_CODES.get(e.status, grpc.StatusCode.INTERNAL), e.message)

    async def ListModels(self, request, context):
        return router_pb2.ListModelsResponse(models=[self.router.model_name])
