"""Greedy outputs through the mesh (SGLang /generate, OpenAI completions, the public gRPC API) are token-identical
to the offline Engine's for the same requests; logprobs agree too."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

from radixmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.conftest import model_path
from tests.e2e.conftest import MODEL
from tests.e2e.mesh import http_get
from tests.engine_utils import parity_prompts

GREEDY = {"max_new_tokens": 16, "temperature": 0.0}


def post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def sse_events(raw: bytes) -> list:
    lines = [ln[len(b"data: "):] for ln in raw.split(b"\n\n") if ln.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.fixture(scope="module")
def prompts():
    return parity_prompts(model_path(MODEL))


@pytest.fixture(scope="module")
def expected(offline, prompts):
    return [r["output_ids"] for r in offline.generate(input_ids=prompts, sampling_params=GREEDY)]


def test_generate_batch_and_stream(mesh, prompts, expected):
    out = json.loads(post(mesh.url + "/generate", {"input_ids": prompts, "sampling_params": GREEDY}))
    assert [r["output_ids"] for r in out] == expected
    assert all(r["meta_info"]["completion_tokens"] == 16 for r in out)
    for ids, want in zip(prompts[:4], expected[:4]):
        events = sse_events(post(mesh.url + "/generate", {"input_ids": ids, "sampling_params": GREEDY,
                                                          "stream": True}))
        assert events[-1]["output_ids"] == want  # cumulative, as SGLang streams by default
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert all(a["text"] == b["text"][:len(a["text"])] for a, b in zip(events, events[1:]))


def test_generate_text_and_logprobs(mesh, offline):
    ref = offline.generate("The mesh routes requests", GREEDY, return_logprob=True, top_logprobs_num=2,
                           logprob_start_len=0)
    got = json.loads(post(mesh.url + "/generate", {"text": "The mesh routes requests", "sampling_params": GREEDY,
                                                   "return_logprob": True, "top_logprobs_num": 2,
                                                   "logprob_start_len": 0}))
    assert got["output_ids"] == ref["output_ids"] and got["text"] == ref["text"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        mine, theirs = got["meta_info"][key], ref["meta_info"][key]
        assert [t for _, t, _ in mine] == [t for _, t, _ in theirs]
        assert [lp for lp, _, _ in mine] == pytest.approx([lp for lp, _, _ in theirs], abs=1e-5, nan_ok=True)
    assert got["meta_info"]["input_token_logprobs"][0][0] is None
    assert [[t for _, t, _ in row] for row in got["meta_info"]["output_top_logprobs"]] == \
        [[t for _, t, _ in row] for row in ref["meta_info"]["output_top_logprobs"]]


def test_openai_completions_with_token_prompts(mesh, offline, prompts, expected):
    for ids, want in zip(prompts[:5], expected[:5]):
        body = {"model": model_path(MODEL), "prompt": ids, "max_tokens": 16, "temperature": 0}
        got = json.loads(post(mesh.url + "/v1/completions", body))
        assert got["choices"][0]["text"] == offline.tokenizer.decode(want)
        assert got["usage"]["completion_tokens"] == 16


def test_public_grpc_api(mesh, offline, prompts, expected):
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        assert list(stub.ListModels(router_pb2.ListModelsRequest()).models) == [model_path(MODEL)]
        sp = common_pb2.SamplingParams(max_new_tokens=16, temperature=0.0)
        for ids, want in zip(prompts, expected):
            for stream in (False, True):
                req = router_pb2.RouterServiceGenerateRequest(input_ids=router_pb2.TokenIdList(ids=ids),
                                                              sampling_params=sp, stream=stream)
                msgs = list(stub.Generate(req, timeout=60))
                done = msgs[-1].complete
                assert list(done.output_ids) == want
                if stream:
                    assert [t for m in msgs[:-1] for t in m.chunk.token_ids] == want
                    assert "".join(m.chunk.text for m in msgs[:-1]) == done.text
        ref = offline.generate("gRPC text in, text out", {"max_new_tokens": 16, "temperature": 0.0})
        msgs = list(stub.Generate(router_pb2.RouterServiceGenerateRequest(text="gRPC text in, text out",
                                                                          sampling_params=sp), timeout=60))
        assert msgs[-1].complete.text == ref["text"]
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(router_pb2.RouterServiceGenerateRequest(
                input_ids=router_pb2.TokenIdList(ids=[1, 99999]), sampling_params=sp), timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "99999" in err.value.details()


def test_info_endpoints_and_grpc_reflection(mesh):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from tests.e2e.mesh import http_get

    status, raw = http_get(mesh.url + "/get_model_info")
    info = json.loads(raw)
    assert status == 200 and info["model_path"] == model_path(MODEL) and info["is_generation"] is True
    assert info["max_context_length"] == 1024 and info["vocab_size"] == 1000
    status, raw = http_get(mesh.url + "/get_server_info")
    server = json.loads(raw)
    assert status == 200 and len(server["workers"]) == 2 and server["router"]["policy"] == "cache_aware"
    assert server["max_total_num_tokens"] > 0 and "api_key" not in server["router"]
    assert http_get(mesh.url + "/health")[0] == 200
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
    assert {"radixmesh.v1.RouterService", "grpc.health.v1.Health"} <= names


def test_generate_batch_stream_tags_every_event_and_ends_each_sample_once(mesh, prompts, expected):
    events = sse_events(post(mesh.url + "/generate", {"input_ids": prompts[:3], "sampling_params": GREEDY,
                                                      "stream": True}))
    assert all("index" in e for e in events)
    finals = [e for e in events if e["meta_info"]["finish_reason"] is not None]
    assert sorted(e["index"] for e in finals) == [0, 1, 2]  # one last event per prompt, none repeated
    assert [next(e for e in finals if e["index"] == i)["output_ids"] for i in range(3)] == expected[:3]
    # one event per chunk: a token each, unless the worker merged the chunks of a consumer that lagged behind (a
    # loaded machine): then fewer, each still a growing prefix of the answer
    first = [e["output_ids"] for e in events if e["index"] == 0]
    assert 8 <= len(first) <= 16 and all(a == first[-1][:len(a)] and len(a) < len(b) for a, b in zip(first, first[1:]))
    failing = sse_events(post(mesh.url + "/generate", {"input_ids": [prompts[0], [5, 99999]],
                                                       "sampling_params": GREEDY, "stream": True}))
    assert "error" in failing[-1] and "99999" in failing[-1]["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as err:  # the router's own rejection: a 400 before any event
        post(mesh.url + "/generate", {"input_ids": [prompts[0], [2**40]], "stream": True})
    assert err.value.code == 400


def test_start_and_stop_profile_on_every_worker(mesh, tmp_path):
    """SGLang's /start_profile and /stop_profile through the router: each worker writes a Chrome trace of the steps
    between them (<time>-<pid>-TP-0.trace.json.gz in output_dir); a second start, a stop with nothing on and bad
    bodies are 400s that say why, and the mesh serves throughout."""
    import gzip

    from tests.e2e.test_mesh_faults import post as post_status

    out = tmp_path / "profiles"
    status, raw = post_status(mesh.url + "/start_profile", {"output_dir": str(out), "activities": ["CPU"]}, None)
    assert status == 200 and raw.decode().startswith("Start profiling.\n"), raw
    assert raw.decode().count("-TP-0.trace.json.gz") == 2  # one per worker
    status, raw = post_status(mesh.url + "/start_profile", b"", None)
    assert status == 400 and "already on" in json.loads(raw)["error"]["message"], raw
    for p in ("The capital of France is", "One, two, three,", "Hello"):
        assert json.loads(post(mesh.url + "/generate", {"text": p, "sampling_params": GREEDY}))["text"]
    status, raw = post_status(mesh.url + "/stop_profile", b"", None)
    assert status == 200 and raw.decode().startswith("Stop profiling."), raw
    traces = sorted(out.glob("*-TP-0*.trace.json.gz"))
    assert len(traces) == 2, list(out.iterdir())
    steps = [sum(e.get("name") == "scheduler.step" for e in json.load(gzip.open(t))["traceEvents"]) for t in traces]
    assert sum(steps) >= 3 * 16, steps  # every request's extend and decodes, on one worker or the other
    status, raw = http_get(mesh.url + "/stop_profile")
    assert status == 400 and "not on" in json.loads(raw)["error"]["message"], raw
    for body, says in (({"num_steps": -1}, "num_steps"), ({"bogus": 1}, "unknown field"),
                       ({"activities": ["TPU"]}, "unknown profiler activities"), ([1], "JSON object")):
        status, raw = post_status(mesh.url + "/start_profile", body, None)
        assert status == 400 and says in json.loads(raw)["error"]["message"], (body, raw)
    status, raw = http_get(mesh.url + "/stop_profile")  # nothing was left on by the refused starts
    assert status == 400
    # all or none: one worker already profiling refuses, and the router stops the one it had started
    from radixmesh.v1 import worker_pb2, worker_pb2_grpc
    from tests.e2e.mesh import internal_channel

    first = json.loads(http_get(mesh.url + "/get_server_info")[1])["workers"][0]["url"]
    with internal_channel(first.removeprefix("grpc://")) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        stub.StartProfile(worker_pb2.StartProfileRequest(output_dir=str(out / "direct")), timeout=30)
        status, raw = post_status(mesh.url + "/start_profile", {"output_dir": str(out / "routed")}, None)
        assert status == 400 and "already on" in json.loads(raw)["error"]["message"], raw
        status, raw = http_get(mesh.url + "/stop_profile")  # the first worker's own profile stops; the other's
        assert status == 200 and raw.decode().count("not stopped") == 1, raw  # was stopped by the router
        assert len(list((out / "direct").glob("*.trace.json.gz"))) == 1
        assert len(list((out / "routed").glob("*.trace.json.gz"))) == 1  # written by the rollback
    assert json.loads(post(mesh.url + "/generate", {"text": "Hello", "sampling_params": GREEDY}))["text"]
