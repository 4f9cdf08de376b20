"""The router's public gRPC API (radixmesh.v1.RouterService): text or token ids in, the worker's stream out. API keys
and the tenant come from metadata as over HTTP (tenants.py): `authorization: Bearer <key>` and the tenant header's
name lower-cased; a refused key is UNAUTHENTICATED, an invalid tenant INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from radixmesh.v1 import router_pb2, router_pb2_grpc, tokenizer_pb2
from radixmesh.services.router import convert
from radixmesh.services.router.admission import Admission, Overloaded, client_key
from radixmesh.services.router.core import Router, RouterError, new_request_id
from radixmesh.services.router.openai_request import MAX_N, sample_seed_error
from radixmesh.services.router.policies import ROUTING_KEY_HEADER, routing_key_var
from radixmesh.services.router.request_fields import adapter_of_model
from radixmesh.services.router.tenants import AuthError, TenantError

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND, 408: grpc.StatusCode.DEADLINE_EXCEEDED,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 501: grpc.StatusCode.UNIMPLEMENTED,
          503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, router: Router):
        self.router = router

    async def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant; aborts the call when its key is refused or its tenant is invalid."""
        resolver = self.router.tenants
        metadata: dict[str, str] = {}
        for key, value in context.invocation_metadata() or ():
            if isinstance(value, str):
                metadata.setdefault(key, value)  # the first value of a repeated key
        header = metadata.get(resolver.metadata_key) if resolver.metadata_key else None
        try:
            return resolver.resolve(metadata.get("authorization"), header)
        except AuthError as e:
            code, message = grpc.StatusCode.UNAUTHENTICATED, str(e)
        except TenantError as e:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        await context.abort(code, message)
        raise AssertionError("context.abort raises")

    async def Generate(self, request: router_pb2.RouterServiceGenerateRequest, context: grpc.aio.ServicerContext):
        metrics = self.router.metrics
        if metrics is None:
            async for out in self._generate(request, context):
                yield out
            return
        started, error = time.monotonic(), "internal"
        try:
            async for out in self._generate(request, context):
                yield out
            error = None
        except asyncio.CancelledError:
            error = "client_closed"
            raise
        except BaseException:  # an abort (the code it set names the error) or an unexpected failure
            code = context.code()
            error = code.name.lower() if isinstance(code, grpc.StatusCode) else "internal"
            raise
        finally:
            metrics.handled_grpc("RouterService/Generate", error, time.monotonic() - started)

    async def _generate(self, request: router_pb2.RouterServiceGenerateRequest, context: grpc.aio.ServicerContext):
        tenant = await self._tenant(context)
        admission = getattr(self.router, "admission", None) or Admission()
        metadata = dict(context.invocation_metadata() or ())
        routing_key_var.set(metadata.get(ROUTING_KEY_HEADER.lower()) or None)  # the manual policy's sticky key
        key = client_key(metadata.get("authorization"), context.peer())
        try:
            await admission.admit(key)
        except Overloaded as e:
            await context.abort(_CODES[e.status], e.message)
        try:
            async for out in self._admitted(request, context, tenant):
                yield out
        finally:
            admission.done()

    async def _admitted(self, request: router_pb2.RouterServiceGenerateRequest, context: grpc.aio.ServicerContext,
                        tenant: str):
        rid = request.request_id or new_request_id()
        try:
            model_lora = await self._model_lora(request.model)
            if request.sampling_params.n > MAX_N:  # a huge n would keep a worker busy for minutes
                raise RouterError(400, f"sampling_params.n must be in [1, {MAX_N}], got {request.sampling_params.n}")
            seed_error = sample_seed_error(request.sampling_params)
            if seed_error:
                raise RouterError(400, f"sampling_params: {seed_error}")
            which = request.WhichOneof("input")
            if which == "text" and self.router.routes_text():
                ids = []  # the worker tokenizes the text (Router.routes_text)
            elif which == "text":
                tokenized = await self.router.tokenize(tokenizer_pb2.TokenizeRequest(text=request.text))
                ids = list(tokenized.input_ids)
            elif which == "input_ids" and request.input_ids.ids:
                ids = list(request.input_ids.ids)
            else:
                raise RouterError(400, "give text or input_ids")
            try:
                worker_request = convert.worker_request(request, rid, ids, tenant, model_lora)
            except ValueError as e:
                raise RouterError(400, str(e)) from None
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

    async def _model_lora(self, model: str) -> str:
        """The LoRA adapter a request's `model` names ("" for none or the served model, as over HTTP: SGLang's
        `<served model>:<adapter>` or a loaded adapter's name); RouterError 404 for a name that is neither, 503
        before any worker said what it serves."""
        router = self.router
        if not model or not router.served_models:
            router.require_model(model)
            return ""
        adapters = await router.lora.names_for(model, router.served_models)
        lora = adapter_of_model(model, router.served_models, adapters)
        if lora is None:
            router.require_model(model)  # raises: a name the mesh does not serve
        return lora or ""

    async def ListModels(self, request, context):
        """What /v1/models lists: the served model, then each loaded LoRA adapter (nothing before any worker said
        what it serves)."""
        await self._tenant(context)
        router = self.router
        if not router.served_models:
            return router_pb2.ListModelsResponse()
        info = router.registry.any_info()
        cards = [router_pb2.ModelCard(id=router.model_name, root=info.model_path if info else router.model_name,
                                      max_model_len=info.max_context_length if info else 0)]
        cards += [router_pb2.ModelCard(id=name, root=path, parent=router.model_name)
                  for name, path in router.lora.adapters().items()]
        return router_pb2.ListModelsResponse(models=[c.id for c in cards], cards=cards)
