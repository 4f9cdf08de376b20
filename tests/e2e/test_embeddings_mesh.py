"""Embeddings through the launched mesh (`services.launch serve --is-embedding`: tokenizer, worker, router as OS
processes): the official `openai` client's embeddings.create and raw HTTP /encode against transformers' pooled
hidden states, Matryoshka dimensions, bad input as 400s naming the field, and the refusals between embedding and
generation models (router and worker)."""

from __future__ import annotations

import base64
import json
import struct
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import torch
import torch.nn.functional as F

from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import model_path
from tests.e2e.mesh import cmdline, internal_channel, openai_client

EMBED = model_path("tiny-qwen3-embed")
TOL = 1e-4
TEXTS = ["Hello there, how are you?", "The river runs past the old mill", "東京 is a city 🙂"]


@pytest.fixture(scope="module")
def client(embed_mesh):
    with openai_client(embed_mesh, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModel, AutoTokenizer

    return AutoModel.from_pretrained(EMBED, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(EMBED)


def reference(hf, ids: list[int], dims: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        last = hf[0](torch.tensor([ids])).last_hidden_state[0, -1]
    return F.normalize(last[:dims] if dims else last, dim=-1)


def assert_close(values, expected: torch.Tensor) -> None:
    got = torch.tensor(list(values), dtype=torch.float32)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < TOL


def post(url: str, body) -> tuple[int, dict | list]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def worker_address(mesh) -> str:
    """host:port of the mesh's (first) worker, from its command line."""
    pid = next(p for name, p in mesh.services().items() if name.startswith("radixmesh.services.worker"))
    argv = cmdline(pid).split()
    return f"127.0.0.1:{argv[argv.index('--port') + 1]}"


def test_openai_client_strings_match_transformers(client, hf):
    one = client.embeddings.create(model=EMBED, input=TEXTS[0])  # the client asks for base64 and decodes it
    ids = hf[1](TEXTS[0]).input_ids
    assert one.object == "list" and one.model == EMBED and len(one.data) == 1
    assert one.data[0].index == 0 and one.data[0].object == "embedding"
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
    assert_close(one.data[0].embedding, reference(hf, ids))
    many = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    for text, d in zip(TEXTS, many.data):
        assert_close(d.embedding, reference(hf, hf[1](text).input_ids))
    assert many.usage.prompt_tokens == sum(len(hf[1](t).input_ids) for t in TEXTS)


def test_openai_client_token_ids_and_dimensions(client, hf):
    ids = [[40, 41, 42, 43, 44, 45, 2], [300, 7]]
    one = client.embeddings.create(model=EMBED, input=ids[0], encoding_format="float", user="someone")
    assert_close(one.data[0].embedding, reference(hf, ids[0]))
    both = client.embeddings.create(model=EMBED, input=ids, dimensions=32)
    for row, d in zip(ids, both.data):
        assert len(d.embedding) == 32
        assert_close(d.embedding, reference(hf, row, 32))


def test_raw_base64_is_little_endian_float32(embed_mesh, hf):
    status, body = post(embed_mesh.url + "/v1/embeddings", {"input": "hello", "encoding_format": "base64"})
    assert status == 200, body
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert_close(struct.unpack(f"<{len(raw) // 4}f", raw), reference(hf, hf[1]("hello").input_ids))


@pytest.mark.parametrize("body, param, words", [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "non-empty"),
    ({"input": ["a", 5]}, "input", "list of strings"),
    ({"input": [[1, 2], []]}, "input", "token ids"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", "float"),
    ({"input": "a", "dimensions": 0}, "dimensions", ">= 1"),
    ({"input": "a", "dimensions": 129}, "dimensions", "between 1 and 128"),
    ({"input": "a", "user": 3}, "user", "string"),
    ({"input": "a", "extra_body": {"temperature": 1}}, "temperature", "unsupported"),
])
def test_bad_openai_input_is_a_400_naming_the_field(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=EMBED, **body)
    assert err.value.body["param"] == param
    assert words in err.value.body["message"]


def test_token_ids_outside_the_vocabulary_are_a_400(client):
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.embeddings.create(model=EMBED, input=[5, 100000])


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")


def test_encode_native_single_and_batch(embed_mesh, hf):
    status, one = post(embed_mesh.url + "/encode", {"text": TEXTS[1], "rid": "mine"})
    assert status == 200, one
    assert one["meta_info"]["id"] == "mine"
    assert one["meta_info"]["prompt_tokens"] == len(hf[1](TEXTS[1]).input_ids)
    assert_close(one["embedding"], reference(hf, hf[1](TEXTS[1]).input_ids))
    status, batch = post(embed_mesh.url + "/encode", {"text": TEXTS})
    assert status == 200 and isinstance(batch, list) and len(batch) == 3
    for text, out in zip(TEXTS, batch):
        assert_close(out["embedding"], reference(hf, hf[1](text).input_ids))
    status, ids = post(embed_mesh.url + "/encode", {"input_ids": [[9, 10, 11], [12]]})
    assert status == 200
    assert_close(ids[0]["embedding"], reference(hf, [9, 10, 11]))
    assert_close(ids[1]["embedding"], reference(hf, [12]))
    # a repeated prompt reuses the prefix cache and gives the same vector
    status, again = post(embed_mesh.url + "/encode", {"text": TEXTS[1]})
    assert again["meta_info"]["cached_tokens"] > 0
    assert_close(again["embedding"], torch.tensor(one["embedding"]))


@pytest.mark.parametrize("body, param", [({}, "text"), ({"text": "a", "input_ids": [1]}, "text"),
                                         ({"text": [1, 2]}, "text"), ({"input_ids": "abc"}, "input_ids"),
                                         ({"text": ["a", "b"], "rid": "one"}, "rid")])
def test_bad_encode_input_is_a_400(embed_mesh, body, param):
    status, err = post(embed_mesh.url + "/encode", body)
    assert status == 400 and err["error"]["param"] == param, err


def test_generation_requests_to_the_embedding_model_are_refused(embed_mesh):
    status, info = post(embed_mesh.url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert status == 400 and "embedding model" in info["error"]["message"]
    with urllib.request.urlopen(embed_mesh.url + "/get_model_info", timeout=30) as r:
        assert json.loads(r.read())["is_generation"] is False
    with internal_channel(worker_address(embed_mesh)) as ch:  # the worker itself refuses Generate
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(worker_pb2.GenerateRequest(request_id="g1", input_ids=[1, 2]), timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Embed" in err.value.details()
        ok = stub.Embed(worker_pb2.EmbedRequest(request_id="e1", inputs=[worker_pb2.EmbedInput(input_ids=[1, 2])]),
                        timeout=30)
        assert len(ok.embeddings) == 1 and ok.embeddings[0].prompt_tokens == 2


def test_embeddings_on_a_generation_model_are_refused(mesh):
    status, err = post(mesh.url + "/v1/embeddings", {"input": "hello"})
    assert status == 400 and "not an embedding model" in err["error"]["message"], err
    status, err = post(mesh.url + "/encode", {"text": "hello"})
    assert status == 400 and "--is-embedding" in err["error"]["message"], err
    with internal_channel(worker_address(mesh)) as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.WorkerServiceStub(ch).Embed(
                worker_pb2.EmbedRequest(request_id="e2", inputs=[worker_pb2.EmbedInput(input_ids=[1])]), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--is-embedding" in e.value.details()
