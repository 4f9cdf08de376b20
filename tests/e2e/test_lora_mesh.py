"""LoRA adapters through the mesh, prefill/decode disaggregated (the adapter's name travels in the worker request to
both sides: the prefill worker computes the prompt's KV with the adapter, the decode worker continues with it):
`radixmesh serve --enable-lora --lora-paths sql=... chat=...`; SGLang's /generate `lora_path` (one per prompt of a
batch), the OpenAI API's `model: "base:adapter"` (or the adapter's own name) and the public gRPC API's lora_path
give transformers + peft's greedy tokens; an unknown adapter is a 400 that names it. At run time, through the
router: /load_lora_adapter puts a new adapter on both workers (then listed by /v1/models and served token-exact),
/unload_lora_adapter takes it off both (refused, with nothing changed, while a request still uses it on the decode
worker), after which it is a 400, and it loads again."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import grpc
import pytest

from radixmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.conftest import model_path
from tests.e2e.conftest import MODEL
from tests.e2e.mesh import internal_channel, running_mesh
from tests.e2e.test_supervision import _healthy_workers, _kill, _restarted, _wait
from tests.engine_utils import parity_prompts
from tests.parity.test_lora import ADAPTERS, NEW, peft_greedy, write_adapter
from tests.reference import hf_greedy

FLAGS = ("--disaggregation", "pd", "--disaggregation-transfer-backend", "shm")
GREEDY = {"temperature": 0, "max_new_tokens": NEW}


def post(url: str, body: dict) -> dict | list:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def refused(url: str, body: dict) -> tuple[int, dict]:
    """The status and error body of a request that must fail."""
    with pytest.raises(urllib.error.HTTPError) as err:
        post(url, body)
    return err.value.code, json.loads(err.value.read())


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_adapters_through_the_pd_mesh_give_peft_s_tokens(tmp_path):
    base = model_path(MODEL)
    paths = {name: write_adapter(base, tmp_path / name, r, a, t, rs, seed=i)
             for i, (name, r, a, t, rs) in enumerate(ADAPTERS)}
    extra = write_adapter(base, tmp_path / "extra", 8, 32, ["q_proj", "up_proj", "o_proj"], True, seed=7)
    prompt = parity_prompts(base)[3]
    want = {None: hf_greedy(base, [prompt], NEW)[0], "extra": peft_greedy(base, extra, [prompt])[0],
            **{n: peft_greedy(base, p, [prompt])[0] for n, p in paths.items()}}
    assert want["extra"] != want[None]
    with running_mesh(base, tmp_path, *FLAGS, "--enable-lora", "--max-lora-rank", "8", "--lora-paths",
                      *[f"{n}={p}" for n, p in paths.items()]) as mesh:
        names = [None, "sql", "chat"]
        out = post(mesh.url + "/generate", {"input_ids": [prompt] * 3, "sampling_params": GREEDY, "lora_path": names})
        assert [r["output_ids"] for r in out] == [want[n] for n in names]
        model = get(mesh.url + "/v1/models")["data"][0]["id"]
        completion = post(mesh.url + "/v1/completions", {"model": f"{model}:chat", "prompt": prompt,
                                                         "max_tokens": NEW, "temperature": 0})
        assert completion["choices"][0]["text"] == out[2]["text"]
        status, body = refused(mesh.url + "/generate", {"input_ids": prompt, "sampling_params": GREEDY,
                                                        "lora_path": "nope"})
        assert status == 400 and "unknown LoRA adapter 'nope' (loaded: chat, sql)" in body["error"]["message"]
        assert _grpc_output(mesh, prompt, "sql") == want["sql"]
        _load_use_unload_reload(mesh, model, prompt, paths, extra, want["extra"])


def _grpc_output(mesh, prompt: list[int], lora: str) -> list[int]:
    """The output ids of the router's public gRPC Generate with `lora_path`."""
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as ch:
        request = router_pb2.RouterServiceGenerateRequest(
            input_ids=router_pb2.TokenIdList(ids=prompt), lora_path=lora,
            sampling_params=common_pb2.SamplingParams(temperature=0, max_new_tokens=NEW))
        msgs = list(router_pb2_grpc.RouterServiceStub(ch).Generate(request, timeout=120))
    return list(msgs[-1].complete.output_ids)


def _load_use_unload_reload(mesh, model: str, prompt: list[int], paths: dict, extra: str, want: list[int]) -> None:
    one = {"input_ids": prompt, "sampling_params": GREEDY, "lora_path": "extra"}
    loaded = post(mesh.url + "/load_lora_adapter", {"lora_name": "extra", "lora_path": extra})
    assert loaded == {"success": True, "error_message": "", "loaded_adapters": {**paths, "extra": extra}}
    assert post(mesh.url + "/generate", one)["output_ids"] == want
    cards = get(mesh.url + "/v1/models")["data"]
    assert [c["id"] for c in cards] == [model, "chat", "extra", "sql"]
    assert {k: cards[2][k] for k in ("root", "parent")} == {"root": extra, "parent": model}
    by_name = post(mesh.url + "/v1/completions", {"model": "extra", "prompt": prompt, "max_tokens": NEW,
                                                  "temperature": 0})
    assert by_name["choices"][0]["text"] == post(mesh.url + "/generate", one)["text"]
    _refusals(mesh, extra)
    _unload_refused_while_in_use(mesh, prompt, want)
    assert _unload_once_idle(mesh, "extra")["loaded_adapters"] == paths
    status, body = refused(mesh.url + "/generate", one)
    assert status == 400 and "unknown LoRA adapter 'extra'" in body["error"]["message"]
    assert [c["id"] for c in get(mesh.url + "/v1/models")["data"]] == [model, "chat", "sql"]
    status, body = refused(mesh.url + "/unload_lora_adapter", {"lora_name": "extra"})
    assert status == 400 and body["success"] is False and "no LoRA adapter named 'extra'" in body["error_message"]
    post(mesh.url + "/load_lora_adapter", {"lora_name": "extra", "lora_path": extra})
    assert post(mesh.url + "/generate", one)["output_ids"] == want


def _refusals(mesh, extra: str) -> None:
    """Bad loads are 400s that name what is wrong, with nothing changed."""
    status, body = refused(mesh.url + "/load_lora_adapter", {"lora_name": "extra", "lora_path": extra})
    assert status == 400 and "already loaded" in body["error"]["message"]
    status, body = refused(mesh.url + "/load_lora_adapter", {"lora_name": "gone", "lora_path": extra + "-missing"})
    assert status == 400 and "adapter_config.json" in body["error"]["message"] and "(prefill)" in body["error_message"]
    assert "gone" not in body["loaded_adapters"]
    status, body = refused(mesh.url + "/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and body["error"]["param"] == "lora_path"


def _unload_refused_while_in_use(mesh, prompt: list[int], want: list[int]) -> None:
    """An unload while a request runs with the adapter on the decode worker is refused there; the prefill worker's
    unload, if it happened, is undone: the adapter still serves token-exact on both sides."""
    long = {"input_ids": prompt, "lora_path": "extra", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True}}
    req = urllib.request.Request(mesh.url + "/generate", data=json.dumps(long).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as stream:
        assert stream.readline().startswith(b"data: ")  # the decode worker is producing tokens
        status, body = refused(mesh.url + "/unload_lora_adapter", {"lora_name": "extra"})
        assert status == 400 and "unfinished request" in body["error"]["message"], body
        assert "extra" in body["loaded_adapters"]
    assert post(mesh.url + "/generate", {"input_ids": prompt, "sampling_params": GREEDY,
                                         "lora_path": "extra"})["output_ids"] == want


def _unload_once_idle(mesh, name: str) -> dict:
    """/unload_lora_adapter, again while a request that was just cancelled still holds the adapter."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return post(mesh.url + "/unload_lora_adapter", {"lora_name": name})
        except urllib.error.HTTPError as e:
            body = e.read()
            assert e.code == 400 and b"unfinished request" in body and time.monotonic() < deadline, body
            time.sleep(0.2)


def _grpc_models(mesh) -> list[tuple[str, str, str]]:
    """The router's public gRPC ListModels: (id, root, parent) of each model."""
    with grpc.insecure_channel(f"127.0.0.1:{mesh.grpc_port}") as ch:
        answer = router_pb2_grpc.RouterServiceStub(ch).ListModels(router_pb2.ListModelsRequest(), timeout=30)
    assert list(answer.models) == [c.id for c in answer.cards]
    return [(c.id, c.root, c.parent) for c in answer.cards]


def _processed(mesh, worker: str) -> float:
    """The router's count of calls sent to `worker` (sgl_router_processed_requests_total)."""
    with urllib.request.urlopen(mesh.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    pattern = r'sgl_router_processed_requests_total\{[^}]*worker="' + re.escape(worker) + r'"[^}]*\} (\S+)'
    match = re.search(pattern, text)
    return float(match.group(1)) if match else 0.0


def test_a_restarted_worker_serves_the_run_time_adapter_again(tmp_path):
    """Two colocated workers, an adapter loaded at run time through the router (listed by the public gRPC
    ListModels as by /v1/models). One worker is killed and the launcher starts it again with its flags only: the
    router loads the adapter there again before routing it requests for it, and those requests (round robin: half
    of them go there) give peft's tokens, as the restarted worker itself does."""
    base = model_path(MODEL)
    extra = write_adapter(base, tmp_path / "extra", 8, 32, ["q_proj", "up_proj", "o_proj"], True, seed=7)
    prompt = parity_prompts(base)[3]
    want = peft_greedy(base, extra, [prompt])[0]
    one = {"input_ids": prompt, "sampling_params": GREEDY, "lora_path": "extra"}
    with running_mesh(base, tmp_path, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
                      "--policy", "round_robin", "--enable-metrics", num_workers=2) as mesh:
        model = get(mesh.url + "/v1/models")["data"][0]["id"]
        post(mesh.url + "/load_lora_adapter", {"lora_name": "extra", "lora_path": extra})
        assert _grpc_models(mesh)[1:] == [("extra", extra, model)] and _grpc_models(mesh)[0][0] == model
        assert post(mesh.url + "/generate", one)["output_ids"] == want
        pid, port = _kill(mesh, "radixmesh.services.worker")
        _wait(lambda: _restarted(mesh, "radixmesh.services.worker", (pid, port)), 60, "the worker was not restarted")
        url = f"127.0.0.1:{port}"

        def has_extra() -> bool:
            try:
                with internal_channel(url) as ch:
                    listing = worker_pb2_grpc.WorkerServiceStub(ch).ListLoraAdapters(
                        worker_pb2.ListLoraAdaptersRequest(), timeout=5)
            except grpc.RpcError:
                return False
            return "extra" in {a.lora_name for a in listing.adapters}

        _wait(has_extra, 120, "the router did not load the adapter on the restarted worker")
        _wait(lambda: _healthy_workers(mesh) == 2, 60, "the restarted worker is not healthy again")
        before = _processed(mesh, url)
        outs = [post(mesh.url + "/generate", one)["output_ids"] for _ in range(6)]
        assert outs == [want] * 6 and _processed(mesh, url) - before >= 2, mesh.log_tail()
        assert _grpc_models(mesh)[1:] == [("extra", extra, model)]
