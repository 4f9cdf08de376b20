"""GET /openapi.json: the document is valid OpenAPI 3.1, lists every route the router's app registers (and no
route it does not), and its request schemas agree with the handlers on examples either side of their checks."""

from __future__ import annotations

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer
from openapi_spec_validator import validate

from radixmesh.services.common.metrics import MetricsSettings, ServiceMetrics
from radixmesh.services.router.__main__ import build_app
from radixmesh.services.router.core import Router
from radixmesh.services.router.openapi import OPENAPI_PATH, document
from radixmesh.services.router.policy_registry import make_policy
from radixmesh.services.router.settings import RouterSettings
from radixmesh.services.router.tokenizer_client import TokenizerClient
from radixmesh.services.router.workers import WorkerRegistry


@pytest.fixture
async def app():
    settings = RouterSettings(tokenizer_url="127.0.0.1:1", policy="round_robin", api_key="sk-x")
    registry = WorkerRegistry(connect_timeout_s=1.0, probe_interval_s=60.0)
    tokenizer = TokenizerClient(settings.tokenizer_url, 1.0)
    router = Router(settings, registry, make_policy(settings.policy, settings, registry), tokenizer)
    try:
        yield build_app(router, ServiceMetrics.from_settings(MetricsSettings(enable_metrics=True), "router"))
    finally:
        await registry.close()
        await tokenizer.close()


@pytest.fixture
async def client_of():
    """Serves an app on loopback for the test's duration: client_of(app) -> aiohttp TestClient."""
    clients = []

    async def make(app):
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client
    yield make
    for c in clients:
        await c.close()


def _registered(app) -> set[tuple[str, str]]:
    """(method, path template) of every route; aiohttp's `{name:regex}` becomes OpenAPI's `{name}`."""
    return {(route.method.lower(), route.resource.canonical) for route in app.router.routes()}


def _documented(doc) -> set[tuple[str, str]]:
    return {(method, path) for path, item in doc["paths"].items() for method in item if method != "parameters"}


def test_the_document_is_valid_openapi_3_1():
    doc = document()
    assert doc["openapi"].startswith("3.1")
    validate(doc)


async def test_every_registered_route_is_documented_and_nothing_else(app):
    registered = _registered(app)
    assert ("get", OPENAPI_PATH) in registered and ("post", "/v1/chat/completions") in registered
    assert ("get", "/v1/models/{model}") in registered
    assert registered == _documented(document())


async def test_the_router_serves_the_document(app, client_of):
    client = await client_of(app)
    resp = await client.get(OPENAPI_PATH, headers={"Authorization": "Bearer sk-x"})
    assert resp.status == 200
    assert await resp.json() == document()
    resp = await client.get(OPENAPI_PATH)
    assert resp.status == 401 and "error" in await resp.json()


def _validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator of one request schema; its `#/components/schemas/...` references resolve inside it."""
    doc = document()
    return jsonschema.Draft202012Validator({**doc["components"]["schemas"][name], "components": doc["components"]})


ACCEPTED = {
    "ChatCompletionRequest": [{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_k": -1,
                               "n": 2, "stop": ["a"], "logit_bias": {"5": -100}, "temperature": None,
                               "tool_choice": "auto", "unknown_field": 1}],
    "CompletionRequest": [{"prompt": "hi"}, {"prompt": [1, 2]}, {"prompt": ["a", [1]], "top_p": 1}],
    "GenerateRequest": [{"text": "hi", "sampling_params": {"max_new_tokens": 1}}, {"input_ids": [[1], [2, 3]]}],
    "EmbeddingRequest": [{"input": "x"}, {"input": [[1, 2]], "encoding_format": "base64"}],
    "EncodeRequest": [{"text": ["a", "b"]}, {"input_ids": [1]}],
    "TokenizeRequest": [{"prompt": "x"}, {"prompt": ["x", "y"], "add_special_tokens": False}],
    "DetokenizeRequest": [{"tokens": [1, 2]}, {"tokens": [[1], [2]]}],
}
REFUSED = {
    "ChatCompletionRequest": [{}, {"messages": []}, {"messages": [{"role": "bot", "content": "x"}]},
                              {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1},
                              {"messages": [{"role": "user", "content": "x"}], "top_k": 0},
                              {"messages": [{"role": "user", "content": "x"}], "n": 129},
                              {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}},
                              {"messages": [{"role": "user", "content": "x"}], "top_p": 0},
                              {"messages": [{"role": "user", "content": "x"}], "stop": [""]}],
    "CompletionRequest": [{"prompt": []}, {"prompt": [-1]}, {"prompt": "x", "logprobs": 21}],
    "GenerateRequest": [{}, {"text": "a", "input_ids": [1]}, {"text": ""}, {"text": "a", "extra": 1},
                        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
                        {"text": "a", "sampling_params": {"bogus": 1}}],
    "EmbeddingRequest": [{"input": ""}, {"input": []}, {"input": "x", "encoding_format": "hex"},
                         {"input": "x", "dimensions": 0}, {"input": "x", "extra": 1}],
    "EncodeRequest": [{}, {"text": "a", "input_ids": [1]}, {"input_ids": "a"}],
    "TokenizeRequest": [{}, {"prompt": 5}, {"prompt": []}],
    "DetokenizeRequest": [{}, {"tokens": "a"}, {"tokens": [-1]}],
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_request_schemas_take_what_the_handlers_take(name):
    validator = _validator(name)
    for body in ACCEPTED[name]:
        assert validator.is_valid(body), (body, list(validator.iter_errors(body))[:1])
    for body in REFUSED[name]:
        assert not validator.is_valid(body), body


def test_start_profile_bodies_the_router_takes_and_refuses():
    """The /start_profile body as the router reads it (SGLang's fields, all optional) agrees with its schema."""
    from radixmesh.services.router.native_api import _profile_request

    schema = _validator("StartProfileRequest")
    for body in ({}, {"output_dir": "/tmp/p", "num_steps": 3, "activities": ["CPU", "GPU"], "with_stack": True,
                      "record_shapes": False}, {"num_steps": None, "profile_by_stage": False}):
        assert schema.is_valid(body), body
        _profile_request(body)
    for body in ({"num_steps": 0}, {"num_steps": True}, {"activities": "CPU"}, {"with_stack": 1}, {"bogus": 1},
                 {"profile_by_stage": True}, {"output_dir": 5}):
        assert not schema.is_valid(body), body
        with pytest.raises(ValueError):
            _profile_request(body)
    assert _profile_request(None).num_steps == 0 and _profile_request({"num_steps": 7}).num_steps == 7


def test_lora_adapter_bodies_the_router_takes_and_refuses():
    """/load_lora_adapter's and /unload_lora_adapter's bodies as the router reads them agree with their schemas."""
    from radixmesh.services.router.lora_api import parse_load, parse_unload
    from radixmesh.services.router.openai_errors import OpenAIError

    load, unload = _validator("LoadLoraAdapterRequest"), _validator("UnloadLoraAdapterRequest")
    for body in ({"lora_name": "sql", "lora_path": "/a/sql"}, {"lora_name": "sql", "lora_path": "/a", "pinned": None},
                 {"lora_name": "s q", "lora_path": " /a", "pinned": True}):
        assert load.is_valid(body), body
        parse_load(body, ("served",))
    for body in ({}, {"lora_name": "sql"}, {"lora_path": "/a"}, {"lora_name": "", "lora_path": "/a"},
                 {"lora_name": "  ", "lora_path": "/a"}, {"lora_name": "x" * 257, "lora_path": "/a"},
                 {"lora_name": "sql", "lora_path": "/a", "pinned": 1}, {"lora_name": "sql", "lora_path": "/a", "x": 1}):
        assert not load.is_valid(body), body
        with pytest.raises(OpenAIError):
            parse_load(body, ("served",))
    assert unload.is_valid({"lora_name": "sql"}) and parse_unload({"lora_name": "sql"}) == "sql"
    for body in ({}, {"lora_name": ""}, {"lora_name": "sql", "lora_path": "/a"}, {"lora_name": 5}):
        assert not unload.is_valid(body), body
        with pytest.raises(OpenAIError):
            parse_unload(body)
