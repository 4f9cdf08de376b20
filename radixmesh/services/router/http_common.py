"""aiohttp plumbing for the router's HTTP API: the API-key check and the request's tenant (tenants.py; /health stays
open), in-flight request counting for graceful shutdown, JSON body parsing, and errors as OpenAI error objects."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

import orjson
from aiohttp import web

from radixmesh.services.common import tracing
from radixmesh.services.common.logs import request_id_var
from radixmesh.services.router.core import RouterError
from radixmesh.services.router.openai_errors import OpenAIError, bad_request, from_status, unauthorized
from radixmesh.services.router.policies import ROUTING_KEY_HEADER, routing_key_var
from radixmesh.services.router.tenants import SHARED, AuthError, TenantError, TenantResolver

log = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health", "/liveness", "/readiness", "/metrics"})
# the admin key's, when one is set
ADMIN_PATHS = frozenset({"/add_worker", "/remove_worker", "/flush_cache", "/start_profile", "/stop_profile",
                         "/load_lora_adapter", "/unload_lora_adapter"})
UNTRACED_PATHS = OPEN_PATHS  # liveness probes and scrapes, many a minute, would drown the request traces
INFLIGHT = web.AppKey("inflight", dict)
TENANT = "radixmesh.tenant"  # request key: the tenant namespace the auth middleware resolved


def error_response(err: OpenAIError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


def make_auth_middleware(tenants: TenantResolver, admin_key: str | None = None):
    """Refuses requests without an accepted API key (401) or with an invalid tenant (400); sets request[TENANT].
    With `admin_key` (--admin-api-key), the admin endpoints take that key and no other (an API key: 403)."""
    admin = f"Bearer {admin_key}".encode("utf-8", "surrogateescape") if admin_key else None

    @web.middleware
    async def auth(request: web.Request, handler):
        if request.path in OPEN_PATHS:
            request[TENANT] = SHARED
            return await handler(request)
        if admin is not None and request.path in ADMIN_PATHS:
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, admin):
                return error_response(_not_admin(tenants, request.headers.get("Authorization")))
            request[TENANT] = SHARED
            return await handler(request)
        header = request.headers.get(tenants.header) if tenants.header else None
        try:
            request[TENANT] = tenants.resolve(request.headers.get("Authorization"), header)
        except AuthError as e:
            return error_response(unauthorized(str(e)))
        except TenantError as e:
            return error_response(bad_request(str(e), param="tenant", code="invalid_tenant"))
        return await handler(request)
    return auth


@web.middleware
async def routing_key_middleware(request: web.Request, handler):
    """The request's sticky routing key (the manual policy's) from the X-SMG-Routing-Key header, as SGLang's
    router reads it; the OpenAI endpoints fall back to the body's `user`."""
    routing_key_var.set(request.headers.get(ROUTING_KEY_HEADER) or None)
    return await handler(request)


def _not_admin(tenants: TenantResolver, authorization: str | None) -> OpenAIError:
    try:
        tenants.resolve(authorization, None)
    except (AuthError, TenantError):
        return unauthorized("this endpoint needs the admin key (--admin-api-key): 'Authorization: Bearer <key>'")
    return OpenAIError(403, "this endpoint needs the admin key (--admin-api-key), not an API key",
                       "permission_error", None, "admin_key_required")


def require_model_kind(router, generation: bool) -> None:
    """A 400 naming `model` when the served model is of the other kind than the endpoint serves (text generation, or
    embeddings: --is-embedding, GetModelInfo's is_generation false); no check before any worker is known."""
    info = router.registry.any_info()
    if info is None or info.is_generation == generation:
        return
    if generation:
        raise bad_request(f"the served model '{router.model_name}' is an embedding model (--is-embedding): it does "
                          "not generate text; use /encode or /v1/embeddings", param="model",
                          code="model_not_generative")
    raise bad_request(f"the served model '{router.model_name}' is a generation model, not an embedding model: "
                      "embeddings need a model served with --is-embedding", param="model", code="model_not_embedding")


def tenant_of(request: web.Request) -> str:
    """The tenant namespace the auth middleware resolved for this request."""
    return request.get(TENANT, SHARED)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Counts requests in flight (shutdown waits for them) and turns escaped errors into OpenAI error objects."""
    counter = _arrived(request)
    try:
        return await handler(request)
    except Exception as e:  # noqa: BLE001 - answered (or re-raised) by _answer_error
        return _answer_error(request, e)
    finally:
        counter["n"] -= 1


@web.middleware
async def traced_errors_middleware(request: web.Request, handler):
    """errors_middleware inside the request's server span, as one middleware (with tracing on it takes
    errors_middleware's place, first in the chain: a middleware layer of its own cost as much again as the span,
    `benchmarks.router --trace-ab`). The span is the root of the request's trace, or a child of the client's W3C
    `traceparent`; everything the router does for the request is under it, errors answered here included. Probes
    and scrapes (UNTRACED_PATHS) get none, nor do requests the sampler leaves out: they take the same path, with no
    coroutine of errors_middleware's in between."""
    url_path = request.path
    span = None if url_path in UNTRACED_PATHS else tracing.server_span(request.headers)
    counter = _arrived(request)
    try:
        try:
            response = await handler(request)
        except Exception as e:  # noqa: BLE001 - answered (or re-raised) by _answer_error
            response = _answer_error(request, e)
        finally:
            counter["n"] -= 1
    except BaseException as e:  # re-raised by _answer_error (a redirect), or a cancellation
        if span is not None:
            name, route = _span_name(request)
            span.finish(name, _HTTP_SPAN[:3], (request.method, url_path, route), e)
        raise
    if span is not None:  # None: a probe, a request the sampler left out, or tracing shut down (at exit)
        status = response.status
        name, route = _span_name(request)
        span.finish(name, _HTTP_SPAN, (request.method, url_path, route, status),
                    f"HTTP {status}" if status >= 500 else None)
    return response


def _span_name(request: web.Request) -> tuple[str, str]:
    """(the server span's name, the route's path) of a request, by its method and matched route."""
    method, route = request.method, request.match_info.route
    named = _SPAN_NAMES.get((method, route))
    if named is None:
        resource = route.resource
        path = resource.canonical if resource is not None else "unmatched"
        named = (f"{method} {path}", path)
        if resource is not None and len(_SPAN_NAMES) < 1024:  # an unmatched request's route is made for it alone
            _SPAN_NAMES[(method, route)] = named
    return named


# the attributes of a request's server span (OpenTelemetry's HTTP semantic conventions)
_HTTP_SPAN = ("http.request.method", "url.path", "http.route", "http.response.status_code")
# (method, route) -> (the server span's name, the route's path), for the app's routes (a bounded number)
_SPAN_NAMES: dict[tuple, tuple[str, str]] = {}


def _arrived(request: web.Request) -> dict:
    counter = request.app[INFLIGHT]
    counter["n"] += 1
    request_id_var.set(request.headers.get("X-Request-Id", "-"))
    return counter


def _answer_error(request: web.Request, e: Exception) -> web.StreamResponse:
    """The response for an error that escaped the handler (call it in an `except` block: what is not an error
    answer, such as a redirect, is raised again)."""
    if isinstance(e, OpenAIError):
        return error_response(e)
    if isinstance(e, RouterError):
        return error_response(from_status(e.status, e.message))
    if isinstance(e, ValueError):
        return error_response(bad_request(str(e)))
    if isinstance(e, ConnectionResetError):  # the client went away mid-response; there is no one left to answer
        log.info("client went away on %s", request.path)
        return web.Response(status=499)
    if isinstance(e, web.HTTPException):
        if e.status >= 400:
            return error_response(from_status(e.status, e.reason))
        raise e
    log.exception("unhandled error on %s", request.path)  # log it, answer 500, keep serving
    return error_response(from_status(500, "internal error"))


# bytes -> b"0" for digits, b" " for anything else: a body holding a run of LONG_DIGITS digits may hold an integer
# past 64 bits, which orjson would parse as a float
_DIGITS = bytes(48 if 48 <= i <= 57 else 32 for i in range(256))
_LONG_DIGITS = b"0" * 19


def parse_json(raw: bytes) -> Any:
    """`json.loads(raw)`, the same value for every body: orjson parses it (a quarter of the instructions: a body
    of 64 token ids costs 26k instead of 72k, `benchmarks.router_instructions`) unless it refuses the body (NaN,
    Infinity, a float past the double range, a lone surrogate escape, nesting past 1024, UTF-16) or the body may
    hold an integer past 64 bits; those go to json.loads, which decides as before."""
    if _LONG_DIGITS not in raw.translate(_DIGITS):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


async def json_body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return parse_json(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # the decoder's nesting limit (about 1000 levels of arrays and objects)
        raise bad_request("the request body is nested too deeply to decode") from None


async def first_then_sse(request: web.Request, items) -> tuple[Any, web.StreamResponse]:
    """The first item of a worker-backed stream, then the started SSE response: an error before the first item is
    still an HTTP error status; after it, errors become events."""
    try:
        first = await anext(items)
    except StopAsyncIteration:
        raise RouterError(500, "the worker ended the request without output") from None
    return first, await start_sse(request)


async def start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp
