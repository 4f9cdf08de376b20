"""GET /openapi.json: an OpenAPI 3.1 description of every HTTP endpoint the router serves.

The request schemas state what the handlers accept (openai_request, generate_api with convert, embeddings_api,
utility_api, native_api): types, enums and the ranges they check; the scalar sampling fields' schemas come from the
sampling field table (sampling_fields), which drives those handlers too. Where a handler ignores unknown fields the
schema allows them (additionalProperties true); where it refuses them (/generate, sampling_params, /v1/embeddings,
/encode) it does not. `null` reads as absent in the OpenAI bodies, so their optional fields also take null. What a
schema cannot say (a prompt longer than the model's context, a token id outside the vocabulary, min_tokens above
max_tokens, a grammar that does not compile) is a 400 all the same. Every error status carries an OpenAI error
object, except the 503 of /readiness and /health_generate, whose body is their report (as their 200's)."""

from __future__ import annotations

import copy
from typing import Any

from aiohttp import web

from radixmesh.services.router.embeddings_api import MAX_INPUTS
from radixmesh.services.router.lora_api import MAX_NAME
from radixmesh.services.router.openai_request import MAX_N, MAX_PROMPTS, MAX_TOP_LOGPROBS
from radixmesh.services.router.request_fields import INT32_MAX
from radixmesh.services.router.sampling_fields import generate_schemas, openai_schemas

OPENAPI_PATH = "/openapi.json"
JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _opt(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` or null (an OpenAI body's null field reads as absent)."""
    return {"anyOf": [schema, {"type": "null"}]}


def _int(low: int, high: int = INT32_MAX, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high, **extra}


def _num(low: float, high: float | None = None, low_open: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "number", ("exclusiveMinimum" if low_open else "minimum"): low}
    if high is not None:
        out["maximum"] = high
    return out


def _obj(props: dict[str, Any], required: tuple[str, ...] = (), extra: bool = True, **more: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": extra, **more}
    if required:
        out["required"] = list(required)
    return out


def _given(name: str) -> dict[str, Any]:
    """The body has `name`, not null."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


BOOL = {"type": "boolean"}
STR = {"type": "string"}
NONEMPTY = {"type": "string", "minLength": 1}

SCHEMAS: dict[str, Any] = {
    "Error": _obj({"error": _obj({"message": STR, "type": STR, "param": {"type": ["string", "null"]},
                                  "code": {"type": ["string", "integer", "null"]}}, ("message", "type"))},
                  ("error",)),
    "TokenId": _int(0),
    "TokenIds": {"type": "array", "items": _ref("TokenId"), "minItems": 1},
    "Stop": {"anyOf": [NONEMPTY, {"type": "array", "items": NONEMPTY}]},
    "LogitBias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                  "additionalProperties": _num(-100, 100),
                  "description": "token id (a decimal string) -> bias added to its logit"},
    "ResponseFormat": {"oneOf": [
        _obj({"type": {"const": "text"}}, ("type",)),
        _obj({"type": {"const": "json_object"}}, ("type",)),
        _obj({"type": {"const": "json_schema"}, "json_schema": _obj({"schema": {"type": "object"}}, ("schema",))},
             ("type", "json_schema"))]},
    "SamplingParams": _obj({k: _opt(v) for k, v in {
        **generate_schemas(), "stop": _ref("Stop"), "stop_token_ids": {"type": "array", "items": _ref("TokenId")},
        "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                       "additionalProperties": {"type": "number"}},
        "json_schema": {"anyOf": [NONEMPTY, {"type": "object"}]}, "regex": NONEMPTY, "ebnf": NONEMPTY,
    }.items()}, extra=False, description="SGLang's sampling_params; null fields read as absent; at most one of "
                                         "json_schema, regex and ebnf; min_new_tokens <= max_new_tokens"),
}

_SAMPLING_FIELDS = {  # shared by chat and text completions (openai_request._sampling and _stream)
    "model": STR, **openai_schemas(), "stop": _ref("Stop"),
    "stop_token_ids": {"type": "array", "items": _ref("TokenId")},
    "logit_bias": _ref("LogitBias"), "response_format": _ref("ResponseFormat"), "regex": NONEMPTY,
    "ebnf": NONEMPTY, "stream": BOOL, "stream_options": _obj({"include_usage": _opt(BOOL)}),
    "user": {"description": "ignored, but a string is the manual policy's routing key"},
}
_TEXT_PART = _obj({"type": {"const": "text"}, "text": STR}, ("type", "text"))
_MESSAGE = _obj({
    "role": {"enum": ["system", "user", "assistant", "tool", "developer"]},
    "content": {"anyOf": [STR, {"type": "null"}, {"type": "array", "items": _TEXT_PART}]},
    "name": _opt(STR), "tool_call_id": _opt(STR), "tool_calls": _opt({"type": "array", "items": {"type": "object"}}),
}, ("role",), description="content may be null or absent only in an assistant message with tool_calls")
_TOOL = _obj({"type": {"const": "function"}, "function": _obj(
    {"name": NONEMPTY, "parameters": _opt({"type": "object"})}, ("name",))},
    ("type", "function"))
_NAMED = _obj({"type": {"const": "function"}, "function": _obj({"name": STR}, ("name",))}, ("type", "function"))

SCHEMAS.update({
    "ChatCompletionRequest": _obj({
        **{k: _opt(v) for k, v in _SAMPLING_FIELDS.items()},
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "tools": _opt({"type": "array", "items": _TOOL}),
        "tool_choice": _opt({"anyOf": [{"enum": ["none", "auto", "required"]}, _NAMED]}),
        "parallel_tool_calls": _opt(BOOL), "separate_reasoning": _opt(BOOL), "logprobs": _opt(BOOL),
        "top_logprobs": _opt(_int(0, MAX_TOP_LOGPROBS)), "continue_final_message": _opt(BOOL),
        "add_generation_prompt": _opt(BOOL), "chat_template_kwargs": _opt({"type": "object"}),
    }, ("messages",), description="unknown fields are ignored; a named tool_choice must name one of the tools; "
                                  "top_logprobs needs logprobs"),
    "CompletionRequest": _obj({
        **{k: _opt(v) for k, v in _SAMPLING_FIELDS.items()},
        "prompt": {"anyOf": [STR, _ref("TokenIds"), {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                                                     "items": {"anyOf": [STR, _ref("TokenIds")]}}]},
        "suffix": _opt(STR), "best_of": _opt(_int(1, MAX_N)), "logprobs": _opt(_int(0, MAX_TOP_LOGPROBS)),
        "echo": _opt(BOOL),
    }, ("prompt",), description="unknown fields are ignored; best_of must equal n; suffix needs the router's "
                                "--completion-template"),
    "GenerateRequest": _obj({
        "text": _opt({"anyOf": [NONEMPTY, {"type": "array", "items": NONEMPTY, "minItems": 1}]}),
        "input_ids": _opt({"anyOf": [_ref("TokenIds"), {"type": "array", "items": _ref("TokenIds"), "minItems": 1}]}),
        "sampling_params": {"anyOf": [{"type": "null"}, _ref("SamplingParams"),
                                      {"type": "array", "items": {"anyOf": [{"type": "null"},
                                                                            _ref("SamplingParams")]}}]},
        "stream": {"type": ["boolean", "null"]}, "return_logprob": {"type": ["boolean", "null"]},
        "return_text_in_logprobs": {"type": ["boolean", "null"]},
        "logprob_start_len": _opt(_int(-INT32_MAX - 1, description="checked (>= -1) when return_logprob")),
        "top_logprobs_num": _opt(_int(-INT32_MAX - 1, description="checked (>= 0) when return_logprob")),
        "token_ids_logprob": _opt({"type": "array", "items": _int(-INT32_MAX - 1),
                                   "description": "checked against the vocabulary when return_logprob"}),
        "rid": {"anyOf": [{"type": "null"}, STR, {"type": "array", "items": {"type": ["string", "null"]}}]},
        "lora_path": {"anyOf": [{"type": "null"}, STR, {"type": "array", "items": {"type": ["string", "null"]}}],
                      "description": "the LoRA adapter's name (workers started with --enable-lora)"},
    }, extra=False, oneOf=[_given("text"), _given("input_ids")],
        description="exactly one of text and input_ids (null: not given); a batch's sampling_params, rid and "
                    "lora_path lists have one entry per prompt"),
    "LoadLoraAdapterRequest": _obj({
        "lora_name": {**NONEMPTY, "maxLength": MAX_NAME, "pattern": r"\S",
                      "description": "the name requests give (lora_path, or model: the name or "
                                     "<served model>:<name>); not the served model's"},
        "lora_path": {**NONEMPTY, "maxLength": 4096, "pattern": r"\S",
                      "description": "a peft adapter directory on the workers' machines"},
        "pinned": _opt(BOOL)}, ("lora_name", "lora_path"), extra=False,
        description="pinned is accepted for SGLang's clients: every adapter stays loaded until unloaded"),
    "UnloadLoraAdapterRequest": _obj({"lora_name": {**NONEMPTY, "maxLength": MAX_NAME, "pattern": r"\S"}},
                                     ("lora_name",), extra=False),
    "LoraAdapterResult": _obj({"success": BOOL, "error_message": STR,
                               "loaded_adapters": {"type": "object", "additionalProperties": STR,
                                                   "description": "adapter name -> the directory it was loaded "
                                                                  "from"}},
                              ("success", "error_message", "loaded_adapters")),
    "StartProfileRequest": _obj({"output_dir": _opt(STR), "num_steps": _opt(_int(1)),
                                 "activities": _opt({"type": "array", "items": {"enum": ["CPU", "GPU"]}}),
                                 "with_stack": _opt({"type": "boolean"}), "record_shapes": _opt({"type": "boolean"}),
                                 "profile_by_stage": _opt({"const": False})}, extra=False),
    "TokenizeRequest": _obj({"prompt": {"anyOf": [STR, {"type": "array", "items": STR, "minItems": 1,
                                                        "maxItems": MAX_PROMPTS}]},
                             "add_special_tokens": _opt(BOOL), "model": _opt(STR)}, ("prompt",)),
    "DetokenizeRequest": _obj({"tokens": {"anyOf": [{"type": "array", "items": _ref("TokenId")},
                                                    {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                                                     "items": {"type": "array", "items": _ref("TokenId")}}]},
                               "skip_special_tokens": _opt(BOOL), "model": _opt(STR)}, ("tokens",)),
    "EmbeddingRequest": _obj({
        "input": {"anyOf": [NONEMPTY, {"type": "array", "items": NONEMPTY, "minItems": 1, "maxItems": MAX_INPUTS},
                            _ref("TokenIds"),
                            {"type": "array", "items": _ref("TokenIds"), "minItems": 1, "maxItems": MAX_INPUTS}]},
        "model": _opt(STR), "dimensions": _opt({"type": "integer", "minimum": 1}),
        "encoding_format": _opt({"enum": ["float", "base64"]}), "user": _opt(STR),
    }, ("input",), extra=False),
    "EncodeRequest": _obj({
        "text": {"anyOf": [NONEMPTY, {"type": "array", "items": NONEMPTY, "minItems": 1, "maxItems": MAX_INPUTS}]},
        "input_ids": {"anyOf": [_ref("TokenIds"), {"type": "array", "items": _ref("TokenIds"), "minItems": 1,
                                                   "maxItems": MAX_INPUTS}]},
        "rid": {"anyOf": [{"type": "null"}, STR, {"type": "array", "items": {"type": ["string", "null"]}}]},
        "dimensions": _opt({"type": "integer", "minimum": 1}), "model": {},
    }, extra=False, oneOf=[{"required": ["text"]}, {"required": ["input_ids"]}]),
})

# ---- responses ----------------------------------------------------------------------------------------------------
_REASONS = {200: "OK", 400: "Bad input (an OpenAI error object names the field)", 401: "Missing or wrong API key",
            403: "An API key where the admin key (--admin-api-key) is needed", 404: "Unknown model, worker or path",
            405: "Method not allowed on this path", 408: "Waited past --queue-timeout-secs in the router's queue",
            413: "Request body over 64 MiB", 429: "Over the concurrency queue or the key's rate limit",
            500: "Internal error", 501: "Not implemented by the worker",
            503: "No healthy worker or tokenizer, or the server is shutting down",
            504: "A worker or the tokenizer did not answer in time"}
_COMMON = (401, 405, 413, 500)  # any endpoint behind the API key: auth, a wrong method, a huge body, a bug
_WORK = (400, 404, 408, 429, 503, 504)  # a request that reaches the tokenizer or a worker
_SSE = {"text/event-stream": {"schema": {**STR, "description": "`data: {json}` events ending with `data: [DONE]`"}}}


def _error(status: int) -> dict[str, Any]:
    return {"description": _REASONS[status], "content": {JSON: {"schema": _ref("Error")}}}


def _ok(schema: dict[str, Any] | None = None, media: str = JSON, stream: bool = False) -> dict[str, Any]:
    content = {media: {"schema": schema or ({"type": "object"} if media == JSON else STR)}}
    return {"description": "OK", "content": {**content, **(_SSE if stream else {})}}


def _op(summary: str, ok: dict, errors: tuple[int, ...] = (), body: str | None = None, open_path: bool = False,
        params: list | None = None, tags: tuple[str, ...] = (), body_required: bool = True) -> dict[str, Any]:
    codes = sorted(set(errors) | ({405, 500} if open_path else set(_COMMON)))
    op: dict[str, Any] = {"summary": summary, "responses": {"200": ok, **{str(c): _error(c) for c in codes}}}
    if body is not None:
        op["requestBody"] = {"required": body_required, "content": {JSON: {"schema": _ref(body)}}}
    if params:
        op["parameters"] = params
    if open_path:
        op["security"] = []
    if tags:
        op["tags"] = list(tags)
    return op


def _query(name: str, schema: dict, required: bool, what: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": schema, "description": what}


_WORKER_URL = _query("url", NONEMPTY, True, "the worker's gRPC address, host:port")
_CARD = _obj({"id": STR, "object": {"const": "model"}, "created": {"type": "integer"}, "owned_by": STR, "root": STR,
              "parent": {"type": ["string", "null"],
                         "description": "a LoRA adapter's: the served model it adapts (null for the served model)"},
              "max_model_len": {"type": ["integer", "null"]}}, ("id", "object"))
_TEXT_OK = _ok(media="text/plain")
_GEN = ("openai",)

PATHS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"post": _op("OpenAI chat completion, whole or streamed (SSE)", _ok(stream=True),
                                         _WORK, "ChatCompletionRequest", tags=_GEN)},
    "/v1/completions": {"post": _op("OpenAI text completion, one prompt or a batch, whole or streamed",
                                    _ok(stream=True), _WORK, "CompletionRequest", tags=_GEN)},
    "/v1/models": {"get": _op("The served model, then each loaded LoRA adapter (root: where it was loaded from, "
                              "parent: the served model)", _ok(_obj({"object": {"const": "list"},
                                                                    "data": {"type": "array", "items": _CARD}})),
                              tags=_GEN)},
    "/v1/models/{model}": {"get": _op("The served model's or a loaded LoRA adapter's card; another name is a 404",
                                      _ok(_CARD), (404,),
                                      params=[{"name": "model", "in": "path", "required": True, "schema": STR,
                                               "description": "the served model name (it may contain '/') or an "
                                                              "adapter's"}],
                                      tags=_GEN)},
    "/v1/embeddings": {"post": _op("OpenAI embeddings (an --is-embedding model)", _ok(), _WORK, "EmbeddingRequest",
                                   tags=_GEN)},
    "/generate": {"post": _op("SGLang generation: text or input_ids, one or a batch, whole or streamed (SSE)",
                              _ok({"anyOf": [{"type": "object"}, {"type": "array"}]}, stream=True),
                              (*_WORK, 501), "GenerateRequest", tags=("sglang",))},
    "/encode": {"post": _op("SGLang embeddings", _ok({"anyOf": [{"type": "object"}, {"type": "array"}]}),
                            _WORK, "EncodeRequest", tags=("sglang",))},
    "/health": {"get": _op("Liveness: the router answers (empty body)", _TEXT_OK, open_path=True,
                           tags=("probes",))},
    "/liveness": {"get": _op("Liveness: the router answers (empty body)", _TEXT_OK, open_path=True,
                             tags=("probes",))},
    "/readiness": {"get": _op("200 when a request could be served now; 503 (same body) when not",
                              _ok(), open_path=True, tags=("probes",))},
    "/health_generate": {"get": _op("Every worker is checked (colocated and decode workers generate a token); "
                                    "503 when no worker, or no prefill and decode pair, is healthy",
                                    _ok(), tags=("sglang",))},
    "/get_model_info": {"get": _op("The served model", _ok(), (503,), tags=("sglang",))},
    "/get_server_info": {"get": _op("The first worker's server info, every worker's under `workers`, the router's "
                                    "settings under `router`", _ok(), tags=("sglang",))},
    "/flush_cache": {"post": _op("Flush every worker's prefix cache (refused while requests run: a 400)",
                                 _TEXT_OK, (400, 403), tags=("admin",))},
    "/start_profile": {m: _op("Every worker profiles its next scheduler steps (torch.profiler; all or none)",
                              _TEXT_OK, (400, 403, 503), "StartProfileRequest", tags=("admin",),
                              body_required=False) for m in ("get", "post")},
    "/stop_profile": {m: _op("Every worker writes its profile; the files, worker by worker", _TEXT_OK, (400, 403, 503),
                             tags=("admin",)) for m in ("get", "post")},
    "/add_worker": {"post": _op("Register a worker (idempotent)", _TEXT_OK, (400, 403),
                                params=[_WORKER_URL, _query("lease_s", {"type": "number", "exclusiveMinimum": 0,
                                                                       "exclusiveMaximum": 86400}, False,
                                                            "the registration lapses unless renewed within this")],
                                tags=("admin",))},
    "/remove_worker": {"post": _op("Forget a worker", _TEXT_OK, (400, 403, 404), params=[_WORKER_URL],
                                   tags=("admin",))},
    "/load_lora_adapter": {"post": _op("Load a LoRA adapter on every worker (all or none: a failure undoes the "
                                       "others' loads and names each failed worker and why)",
                                       _ok(_ref("LoraAdapterResult")), (400, 403, 503, 504),
                                       "LoadLoraAdapterRequest", tags=("admin", "sglang"))},
    "/unload_lora_adapter": {"post": _op("Unload a LoRA adapter from every worker that has it (all or none; a 400 "
                                         "for one no worker has, or one that unfinished requests use)",
                                         _ok(_ref("LoraAdapterResult")), (400, 403, 503, 504),
                                         "UnloadLoraAdapterRequest", tags=("admin", "sglang"))},
    "/metrics": {"get": _op("Prometheus metrics (served when metrics are on: --enable-metrics)",
                            _ok(media="text/plain"), open_path=True, tags=("probes",))},
    OPENAPI_PATH: {"get": _op("This document", _ok({"type": "object"}), tags=("meta",))},
}
_TOKENIZE_OK = _ok(_obj({"tokens": {"type": "array"}, "count": {"type": ["integer", "array"]},
                         "max_model_len": {"type": ["integer", "null"]}}, ("tokens", "count")))
for _prefix in ("", "/v1"):
    PATHS[_prefix + "/tokenize"] = {"post": _op("Tokenize one prompt or a batch", _TOKENIZE_OK, _WORK,
                                                "TokenizeRequest", tags=("sglang",))}
    PATHS[_prefix + "/detokenize"] = {"post": _op("Detokenize one token list or a batch",
                                                  _ok(_obj({"text": {"type": ["string", "array"]}}, ("text",))),
                                                  _WORK, "DetokenizeRequest", tags=("sglang",))}
for _probe in ("/readiness", "/health_generate"):  # a 503 carries the report, not an error object
    PATHS[_probe]["get"]["responses"]["503"] = {**_ok(), "description": "Not ready: the same report"}
for _item in PATHS.values():  # aiohttp answers HEAD wherever it answers GET: the same statuses, no body
    if "get" in _item:
        _item["head"] = {**copy.deepcopy(_item["get"]), "summary": "HEAD of: " + _item["get"]["summary"]}
        _item["head"]["responses"] = {code: {"description": r["description"]}
                                      for code, r in _item["head"]["responses"].items()}


def document() -> dict[str, Any]:
    """The OpenAPI document (a fresh copy: callers may change it)."""
    return copy.deepcopy({
        "openapi": "3.1.0",
        "info": {"title": "radixmesh router", "version": "1",
                 "description": "OpenAI-compatible and SGLang-native HTTP API of the radixmesh router. With "
                                "--api-key every endpoint but the probes and /metrics needs "
                                "`Authorization: Bearer <key>`; with --admin-api-key the admin endpoints take that "
                                "key instead."},
        "paths": PATHS,
        "components": {"schemas": SCHEMAS, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
    })


_DOC = web.AppKey("openapi_document", dict)


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(request.app[_DOC])


def add_routes(app: web.Application) -> None:
    app[_DOC] = document()
    app.router.add_get(OPENAPI_PATH, openapi_json)
