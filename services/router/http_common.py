"""aiohttp plumbing for the router's HTTP API: the API-key check (constant time; /health stays open), in-flight
request counting for graceful shutdown, JSON body parsing, and errors as OpenAI error objects."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from aiohttp import web

from services.common.logs import request_id_var
from services.router.core import RouterError
from services.router.openai_errors import OpenAIError, bad_request, from_status, unauthorized

log = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health"})
INFLIGHT = web.AppKey("inflight", dict)


def error_response(err: OpenAIError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


def make_auth_middleware(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def auth(request: web.Request, handler):
        if expected is not None and request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                return error_response(unauthorized())
        return await handler(request)
    return auth


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Counts requests in flight (shutdown waits for them) and turns escaped errors into OpenAI error objects."""
    counter = request.app[INFLIGHT]
    counter["n"] += 1
    request_id_var.set(request.headers.get("X-Request-Id", "-"))
    try:
        return await handler(request)
    except OpenAIError as e:
        return error_response(e)
    except RouterError as e:
        return error_response(from_status(e.status, e.message))
    except ValueError as e:
        return error_response(bad_request(str(e)))
    except ConnectionResetError:  # the client went away mid-response; there is no one left to answer
        log.info("client went away on %s", request.path)
        return web.Response(status=499)
    except web.HTTPException as e:
        if e.status >= 400:
            return error_response(from_status(e.status, e.reason))
        raise
    except Exception:  # noqa: BLE001 - log it, answer 500, keep serving
        log.exception("unhandled error on %s", request.path)
        return error_response(from_status(500, "internal error"))
    finally:
        counter["n"] -= 1


async def json_body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


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
