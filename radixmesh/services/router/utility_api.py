"""SGLang's tokenizer endpoints on the router: POST /tokenize and /detokenize (also under /v1/), answered by the
tokenizer service.

/tokenize {"prompt": str | [str, ...], "add_special_tokens": bool = true, "model": optional}
    -> {"tokens": [ids] | [[ids], ...], "count": n | [n, ...], "max_model_len": the served context length}
/detokenize {"tokens": [ids] | [[ids], ...], "skip_special_tokens": bool = false, "model": optional}
    -> {"text": str | [str, ...]}
A batch answers with lists in the order given. Bad input is a 400 naming the field; an unknown model a 404."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from radixmesh.v1 import tokenizer_pb2
from radixmesh.services.router.http_common import json_body
from radixmesh.services.router.native_api import ROUTER
from radixmesh.services.router.openai_errors import bad_request
from radixmesh.services.router.openai_request import MAX_PROMPTS
from radixmesh.services.router.request_fields import INT32_MAX, Fields, are_token_ids, served_model, show


def _strings(f: Fields, name: str) -> tuple[list[str], bool]:
    """(the strings, whether the field was a batch)."""
    value = f.body.get(name)
    if isinstance(value, str):
        return [value], False
    if isinstance(value, list) and value and len(value) <= MAX_PROMPTS and all(isinstance(v, str) for v in value):
        return value, True
    raise f.fail(name, f"must be a string or a list of 1 to {MAX_PROMPTS} strings")


def _token_lists(f: Fields, name: str) -> tuple[list[list[int]], bool]:
    value = f.body.get(name)
    if isinstance(value, list) and are_token_ids(value):
        return [value], False
    if isinstance(value, list) and value and len(value) <= MAX_PROMPTS and all(
            isinstance(v, list) and are_token_ids(v) for v in value):
        return value, True
    raise bad_request(f"'{name}' must be a list of token ids (each in [0, {INT32_MAX}]) or a list of such lists, "
                      f"got {show(value)}", param=name)


def _checked(body: Any, router) -> Fields:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    f = Fields(body)
    served_model(f, [router.model_name])
    return f


async def tokenize(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    f = _checked(await json_body(request), router)
    prompts, batch = _strings(f, "prompt")
    special = f.bool("add_special_tokens")
    results = await asyncio.gather(*(router.tokenize(tokenizer_pb2.TokenizeRequest(
        text=p, add_special_tokens=True if special is None else special)) for p in prompts))
    tokens = [list(r.input_ids) for r in results]
    info = router.registry.any_info()
    body = {"tokens": tokens if batch else tokens[0], "count": [len(t) for t in tokens] if batch else len(tokens[0]),
            "max_model_len": info.max_context_length if info else None}
    return web.json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    f = _checked(await json_body(request), router)
    seqs, batch = _token_lists(f, "tokens")
    skip = f.bool("skip_special_tokens")
    texts = await asyncio.gather(*(router.detokenize(s, bool(skip)) for s in seqs))
    return web.json_response({"text": list(texts) if batch else texts[0]})


def add_routes(app: web.Application) -> None:
    for prefix in ("", "/v1"):
        app.router.add_post(prefix + "/tokenize", tokenize)
        app.router.add_post(prefix + "/detokenize", detokenize)
