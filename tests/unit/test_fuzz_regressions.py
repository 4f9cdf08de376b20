"""Regressions found by the endpoint fuzz suite (tests/fuzz), checked here without a mesh: a body nested past the
JSON decoder's limit is a 400 (it was a 500), /generate's n is bounded (a huge n kept a worker busy for minutes),
a seed whose last sample's seed + j overflows 64 bits is refused (it failed the worker's sampling step), logit_bias
keys are plain decimal token ids, max_tokens is checked beside max_completion_tokens, and /v1/embeddings'
encoding_format refuses false, 0 and ""."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from radixmesh.services.router import convert
from radixmesh.services.router.embeddings_api import parse_openai
from radixmesh.services.router.http_common import INFLIGHT, errors_middleware, json_body
from radixmesh.services.router.openai_errors import OpenAIError
from radixmesh.services.router.openai_request import parse_completion

SERVED = {"m"}


async def _echo(request: web.Request) -> web.Response:
    return web.json_response({"got": type(await json_body(request)).__name__})


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                                 b'{"k":' * 3000 + b"1" + b"}" * 3000])
async def test_a_body_nested_too_deeply_is_a_400(raw):
    app = web.Application(middlewares=[errors_middleware])
    app[INFLIGHT] = {"n": 0}
    app.router.add_post("/x", _echo)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/x", data=raw)
        assert resp.status == 400
        assert "nested too deeply" in (await resp.json())["error"]["message"]
        resp = await client.post("/x", data=b"[" * 100 + b"]" * 100)
        assert resp.status == 200 and await resp.json() == {"got": "list"}


def test_native_n_is_bounded_as_openai_n_is():
    assert convert.sampling_params({"n": 128}).n == 128
    for n in (0, 129, 100_000, 2**31 - 1):
        with pytest.raises(ValueError, match=r"sampling_params.n must be in \[1, 128\]"):
            convert.sampling_params({"n": n})


@pytest.mark.parametrize("key", [" 5", "+5", "5_0", "\u0665", "-1", "1.0", "", "9" * 5000])
def test_logit_bias_keys_are_decimal_token_ids(key):
    with pytest.raises(OpenAIError, match="logit_bias"):
        parse_completion({"prompt": "x", "logit_bias": {key: 1}}, SERVED)
    with pytest.raises(ValueError, match="logit_bias"):
        convert.sampling_params({"logit_bias": {key: 1}})


def test_logit_bias_digits_still_work():
    assert dict(parse_completion({"prompt": "x", "logit_bias": {"05": 2}}, SERVED).sampling.logit_bias) == {5: 2.0}
    assert dict(convert.sampling_params({"logit_bias": {"7": -3}}).logit_bias) == {7: -3.0}


@pytest.mark.parametrize("fmt", [False, 0, "", [], {}])
def test_embedding_encoding_format_must_be_named(fmt):
    with pytest.raises(OpenAIError, match="encoding_format"):
        parse_openai({"input": "x", "encoding_format": fmt}, ("m",))
    assert parse_openai({"input": "x", "encoding_format": None}, ("m",))[1] == "float"


def test_max_tokens_is_checked_beside_max_completion_tokens():
    with pytest.raises(OpenAIError, match="max_tokens"):
        parse_completion({"prompt": "x", "max_completion_tokens": 2, "max_tokens": False}, SERVED)
    assert parse_completion({"prompt": "x", "max_completion_tokens": 2, "max_tokens": 9}, SERVED).sampling \
        .max_new_tokens == 2


def test_a_seed_that_overflows_for_the_last_sample_is_refused():
    """Sample j draws with seed + j: past 2**63 - 1 the worker's sampling step failed and aborted the whole step."""
    top = 2**63 - 1
    assert parse_completion({"prompt": "x", "seed": top - 2, "n": 3}, SERVED).sampling.sampling_seed == top - 2
    assert parse_completion({"prompt": "x", "seed": top}, SERVED).sampling.sampling_seed == top
    with pytest.raises(OpenAIError, match="seed"):
        parse_completion({"prompt": "x", "seed": top - 1, "n": 3}, SERVED)
    assert convert.sampling_params({"sampling_seed": top - 1, "n": 2}).sampling_seed == top - 1
    with pytest.raises(ValueError, match="seed"):
        convert.sampling_params({"sampling_seed": top, "n": 2})
