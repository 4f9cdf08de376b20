"""Embeddings on the router: OpenAI's POST /v1/embeddings and SGLang's POST /encode.

The body is validated here (a 400 names the field), text inputs are tokenized by the tokenizer service (with the
tokenizer's special tokens: an embedding checkpoint's tokenizer appends the token it pools), and one Embed call
carries every input of the request to one worker, whose engine batches them. Embeddings are served by workers of an
embedding model (--is-embedding; GetModelInfo's is_generation is false): a colocated worker, or in a PD mesh a
prefill worker (an embedding is a prefill forward with nothing to hand over to a decode worker). A worker that is
unavailable before it answered is marked unhealthy and the request goes to another, as generation requests do."""

from __future__ import annotations

import array
import asyncio
import base64
import sys
import time
from typing import Any, NamedTuple

import grpc
from aiohttp import web

from radixmesh.v1 import tokenizer_pb2, worker_pb2
from radixmesh.services.common import tracing
from radixmesh.services.common.logs import request_id_var
from radixmesh.services.router.core import WORKER_FAULTS, Router, RouterError, new_request_id, status_of
from radixmesh.services.router.http_common import json_body, require_model_kind, tenant_of
from radixmesh.services.router.merge import each
from radixmesh.services.router.native_api import ROUTER
from radixmesh.services.router.openai_errors import bad_request
from radixmesh.services.router.request_fields import Fields, are_token_ids, served_model
from radixmesh.services.router.policies import routing_key_var
from radixmesh.services.router.resilience import attempts_of

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
_OPENAI_KEYS = frozenset({"input", "model", "dimensions", "encoding_format", "user"})
_ENCODE_KEYS = frozenset({"text", "input_ids", "rid", "dimensions", "model"})


class EmbedInputs(NamedTuple):
    """What one request asks for: texts to tokenize, or token id lists (exactly one is set), and `dimensions`."""

    texts: list[str] | None
    id_lists: list[list[int]] | None
    dimensions: int | None
    is_batch: bool


class _RouteKey(NamedTuple):
    """What a routing policy reads of a request (Router.pick): the prompt's ids and the tenant."""

    input_ids: list[int]
    tenant: str


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and are_token_ids(x)


def _inputs(value: Any, param: str, ids_only: bool = False) -> tuple[list[str] | None, list[list[int]] | None, bool]:
    """(texts, id lists, is_batch) from a string, a list of strings, a list of token ids or a list of such lists."""
    what = ("a non-empty list of token ids or a list of them" if ids_only else
            "a non-empty string, a list of strings, a list of token ids or a list of lists of token ids")
    if isinstance(value, str) and not ids_only:
        if not value:
            raise bad_request(f"'{param}' must not be empty", param=param)
        return [value], None, False
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{param}' must be {what}", param=param)
    if len(value) > MAX_INPUTS:
        raise bad_request(f"'{param}' has {len(value)} inputs; at most {MAX_INPUTS} are allowed", param=param)
    if _is_ids(value):
        return None, [value], False
    if all(_is_ids(x) for x in value):
        return None, value, True
    if not ids_only and all(isinstance(x, str) for x in value):
        empty = [i for i, x in enumerate(value) if not x]
        if empty:
            raise bad_request(f"'{param}[{empty[0]}]' must not be empty", param=f"{param}[{empty[0]}]")
        return value, None, True
    raise bad_request(f"'{param}' must be {what} (token ids are integers >= 0)", param=param)


def _dimensions(body: dict) -> int | None:
    d = body.get("dimensions")
    if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
        raise bad_request(f"'dimensions' must be an integer >= 1, got {d!r}", param="dimensions")
    return d


def _unknown(body: Any, known: frozenset[str]) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    extra = sorted(set(body) - known)
    if extra:
        raise bad_request(f"unsupported field(s): {', '.join(extra)}", param=extra[0])
    return body


def parse_openai(body: Any, served_models: tuple[str, ...]) -> tuple[EmbedInputs, str]:
    """A /v1/embeddings body -> (inputs, encoding format); OpenAIError 400 naming the field, 404 for another model."""
    body = _unknown(body, _OPENAI_KEYS)
    served_model(Fields(body), served_models)
    if "input" not in body:
        raise bad_request("'input' is required", param="input")
    texts, ids, is_batch = _inputs(body["input"], "input")
    fmt = body.get("encoding_format")
    fmt = "float" if fmt is None else fmt  # (not `or`: false, 0 and "" are bad values, not absent ones)
    if fmt not in ("float", "base64"):
        raise bad_request(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", param="encoding_format")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", param="user")
    if user and routing_key_var.get() is None:  # the sticky routing key (manual policy), as for completions
        routing_key_var.set(user)
    return EmbedInputs(texts, ids, _dimensions(body), is_batch), fmt


def parse_encode(body: Any) -> tuple[EmbedInputs, list[str]]:
    """A /encode body (SGLang's: `text` or `input_ids`, one or a batch) -> (inputs, the rid of each input)."""
    body = _unknown(body, _ENCODE_KEYS)
    if ("text" in body) == ("input_ids" in body):
        raise bad_request("give exactly one of 'text' and 'input_ids'", param="text")
    param = "text" if "text" in body else "input_ids"
    value = body[param]
    if param == "text" and not (isinstance(value, str) or (isinstance(value, list) and value and
                                                           all(isinstance(t, str) for t in value))):
        raise bad_request("'text' must be a non-empty string or a list of them", param="text")
    texts, ids, is_batch = _inputs(value, param, ids_only=param == "input_ids")
    n = len(texts if texts is not None else ids)
    rid = body.get("rid")
    rids = rid if isinstance(rid, list) else [rid] * n
    if len(rids) != n or (isinstance(rid, str) and n > 1) or not all(r is None or isinstance(r, str) for r in rids):
        raise bad_request("'rid' must be a string (a list of strings, one per input, for a batch)", param="rid")
    return EmbedInputs(texts, ids, _dimensions(body), is_batch), [r or new_request_id() for r in rids]


async def embed(router: Router, inputs: EmbedInputs, tenant: str) -> list[worker_pb2.Embedding]:
    """Every input's embedding, in order: tokenized, then one Embed call (retried on another worker when the
    chosen one was unavailable). RouterError with the HTTP status on failure."""
    ids = inputs.id_lists
    if ids is None:
        done = await each([router.tokenize(tokenizer_pb2.TokenizeRequest(text=t)) for t in inputs.texts])
        ids = [list(t.input_ids) for t in done]
    rid = new_request_id()
    request_id_var.set(rid)
    tracing.set_attributes(request_id=rid, inputs=len(ids))
    request = worker_pb2.EmbedRequest(request_id=rid, tenant=tenant,
                                      inputs=[worker_pb2.EmbedInput(input_ids=x) for x in ids])
    if inputs.dimensions is not None:
        request.dimensions = inputs.dimensions
    tried: set[str] = set()
    attempts = attempts_of(router.settings)
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(router.backoff.delay_s(attempt))
        worker = await _choose(router, _RouteKey(ids[0], tenant), tried)
        try:
            return list((await _call(router, worker, request)).embeddings)
        except _Unavailable as e:
            if attempt == attempts - 1:
                raise RouterError(503, str(e)) from None
    raise RouterError(503, "no worker answered")


class _Unavailable(Exception):
    pass


async def _choose(router: Router, key: _RouteKey, tried: set[str]):
    """A healthy worker that runs the engine whole: a colocated one, else (a PD mesh) a prefill one."""
    return await router.choose(key, tried, "colocated" if router.registry.healthy("null") else "prefill")


async def _call(router: Router, worker, request: worker_pb2.EmbedRequest) -> worker_pb2.EmbedResponse:
    verdict = worker.breaker.release
    worker.in_flight += 1
    try:
        with tracing.span("worker Embed", "client", worker=worker.url):
            response = await worker.stub.Embed(request, timeout=router.settings.request_timeout_s)
        verdict = worker.breaker.success
        return response
    except grpc.aio.AioRpcError as e:
        code, details = e.code(), e.details() or e.code().name
        if code not in WORKER_FAULTS:  # the request's fault (bad input): the worker is fine
            verdict = worker.breaker.success
            raise RouterError(status_of(code), details) from None
        verdict = worker.breaker.failure
        if code != grpc.StatusCode.UNAVAILABLE:
            raise RouterError(status_of(code), details) from None
        router.registry.mark_failed(worker, details)
        raise _Unavailable(f"worker {worker.url} failed: {details}") from None
    finally:
        verdict()
        worker.in_flight -= 1


def _encoded(values, fmt: str) -> list[float] | str:
    if fmt == "float":
        return list(values)
    packed = array.array("f", values)  # float32; OpenAI's base64 is little-endian float32
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


async def _embed_or_400(router: Router, inputs: EmbedInputs, tenant: str) -> list[worker_pb2.Embedding]:
    try:
        return await embed(router, inputs, tenant)
    except RouterError as e:
        if e.status == 400 and e.message.startswith("dimensions"):  # the worker checks it against the model
            raise bad_request(e.message, param="dimensions") from None
        raise


async def openai_embeddings(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    inputs, fmt = parse_openai(await json_body(request), router.served_models)
    require_model_kind(router, generation=False)
    results = await _embed_or_400(router, inputs, tenant_of(request))
    tokens = sum(r.prompt_tokens for r in results)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(r.values, fmt)} for i, r in enumerate(results)]
    return web.json_response({"object": "list", "data": data, "model": router.model_name,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def encode(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    inputs, rids = parse_encode(await json_body(request))
    require_model_kind(router, generation=False)
    started = time.monotonic()
    results = await _embed_or_400(router, inputs, tenant_of(request))
    latency = time.monotonic() - started
    out = [{"embedding": list(r.values), "meta_info": {"id": rid, "prompt_tokens": r.prompt_tokens,
                                                        "cached_tokens": r.cached_tokens, "e2e_latency": latency}}
           for rid, r in zip(rids, results)]
    return web.json_response(out if inputs.is_batch else out[0])


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", openai_embeddings)
    app.router.add_post("/encode", encode)
