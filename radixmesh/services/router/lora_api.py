"""SGLang's LoRA endpoints on the router (admin endpoints: with --admin-api-key they take that key):

POST /load_lora_adapter {"lora_name": str, "lora_path": str, "pinned": bool (optional; every adapter stays loaded
    until unloaded here)} loads a peft adapter directory (on the workers' machines) on every worker;
POST /unload_lora_adapter {"lora_name": str} unloads it from every worker that has it.
Both answer SGLang's {"success": true, "error_message": "", "loaded_adapters": {name: path}}; a change is made on
every worker or on none (services/router/lora_fanout.py), and a worker that restarts or joins later gets the
run-time changes before it is routed an adapter (services/router/lora_sync.py). With --router-workers N, changes
made through different processes are made one at a time, and every process routes by a change once it is answered
(services/router/lora_peers.py). A failure is an OpenAI error object (400 for bad input or what the workers
refused, with each worker's reason; 503/504 when one could not be reached in time; 503 when another process's
change held the turn too long) that also carries SGLang's fields, success false."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from radixmesh.services.router.errors import RouterError
from radixmesh.services.router.http_common import json_body
from radixmesh.services.router.lora_fanout import LoraFanout
from radixmesh.services.router.native_api import ROUTER
from radixmesh.services.router.openai_errors import OpenAIError, bad_request, from_status
from radixmesh.services.router.request_fields import show

log = logging.getLogger(__name__)
FANOUT = web.AppKey("lora_fanout", LoraFanout)
MAX_NAME = 256
LOAD_FIELDS = ("lora_name", "lora_path", "pinned")
UNLOAD_FIELDS = ("lora_name",)


class LoraError(OpenAIError):
    """A refused or failed change: the OpenAI error object plus SGLang's fields."""

    def __init__(self, status: int, message: str, loaded: dict[str, str], param: str | None = None):
        err = from_status(status, message)
        super().__init__(err.status, err.message, err.type, param, err.code)
        self.loaded = loaded

    def body(self) -> dict[str, Any]:
        return {**super().body(), "success": False, "error_message": self.message, "loaded_adapters": self.loaded}


def _fields(body: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise bad_request(f"unknown field(s) {unknown}; this endpoint takes {list(allowed)}")
    return body


def _text(body: dict, name: str, limit: int = 4096) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value.strip() or len(value) > limit:
        raise bad_request(f"'{name}' must be a non-empty string of at most {limit} characters, got {show(value)}",
                          param=name)
    return value


def parse_load(body: Any, served: tuple[str, ...]) -> tuple[str, str]:
    """(name, path) of a /load_lora_adapter body; OpenAIError 400 naming the field."""
    body = _fields(body, LOAD_FIELDS)
    name, path = _text(body, "lora_name", MAX_NAME), _text(body, "lora_path")
    if name in served:
        raise bad_request(f"'lora_name' {name!r} is the served model's name: an adapter needs a name of its own",
                          param="lora_name")
    if body.get("pinned") is not None and not isinstance(body["pinned"], bool):
        raise bad_request(f"'pinned' must be a boolean, got {show(body['pinned'])}", param="pinned")
    return name, path


def parse_unload(body: Any) -> str:
    return _text(_fields(body, UNLOAD_FIELDS), "lora_name", MAX_NAME)


async def _change(request: web.Request, change) -> web.Response:
    """Run `change(fanout, body)` to its end (a client that leaves does not cut it in the middle, with some workers
    changed and the other router processes not told); SGLang's answer, or a LoraError with the adapters loaded after
    it."""
    router = request.app[ROUTER]
    try:
        task = asyncio.ensure_future(change(request.app[FANOUT], await json_body(request)))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_log_unanswered)
            raise
    except OpenAIError as e:
        raise LoraError(e.status, e.message, router.lora.adapters(), e.param) from None
    except RouterError as e:
        raise LoraError(e.status, e.message, router.lora.adapters()) from None
    return web.json_response({"success": True, "error_message": "", "loaded_adapters": router.lora.adapters()})


def _log_unanswered(task: asyncio.Task) -> None:
    """A change whose caller left: how it ended, since nobody else hears of it."""
    if not task.cancelled() and task.exception() is not None:
        log.info("a LoRA adapter change whose caller left failed: %s", task.exception())


async def load_lora_adapter(request: web.Request) -> web.Response:
    served = request.app[ROUTER].served_models
    return await _change(request, lambda fanout, body: fanout.load(*parse_load(body, served)))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    return await _change(request, lambda fanout, body: fanout.unload(parse_unload(body)))


def add_routes(app: web.Application) -> None:
    router = app[ROUTER]
    peers = getattr(router, "peers", None)  # one of several router processes (services/router/peers.py)
    app[FANOUT] = LoraFanout(router.registry, router.settings.lora_timeout_s, router.lora.intent,
                             peers.lora if peers is not None else None)
    router.lora.sync.load_timeout_s = router.settings.lora_timeout_s  # resyncs of (re)joining workers, too
    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)
