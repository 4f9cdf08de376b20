"""The router's LoRA logic that needs no worker: which adapter a request's `model` names (SGLang's
`<served model>:<adapter>` or the adapter's own name), the public gRPC request's lora_path into the worker's request,
the load/unload bodies' checks, how a failed fan-out is answered, a worker poll that a change overtook, and
cache-aware routing keyed by the request's adapter (the keys the same in every router process). The routing filter
and the fan-out against real workers: tests/services/test_router_lora.py."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest

from radixmesh.engine.request import cache_namespace
from radixmesh.v1 import router_pb2, worker_pb2
from radixmesh.services.router import convert
from radixmesh.services.router.lora_api import parse_load, parse_unload
from radixmesh.services.router.lora_fanout import Outcome, _failure
from radixmesh.services.router.lora_state import LoraState
from radixmesh.services.router.openai_errors import OpenAIError
from radixmesh.services.router.policies import BLOCK, CacheAware, block_keys
from radixmesh.services.router.request_fields import Fields, adapter_of_model, served_model

SERVED = ("org/llama:8b",)


def test_a_model_names_the_base_or_an_adapter():
    assert adapter_of_model("", SERVED) == "" and adapter_of_model("org/llama:8b", SERVED) == ""
    assert adapter_of_model("org/llama:8b:sql", SERVED) == "sql"  # the served name holds a ':' itself
    assert adapter_of_model("sql", SERVED, ["sql"]) == "sql"
    assert adapter_of_model("sql", SERVED) is None and adapter_of_model("org/llama:8b:", SERVED) is None
    assert served_model(Fields({"model": "sql"}), SERVED, ["chat", "sql"]) == "sql"
    with pytest.raises(OpenAIError) as err:
        served_model(Fields({"model": "nope"}), SERVED, ["sql"])
    assert err.value.status == 404 and "serves: org/llama:8b, sql" in err.value.message


def test_the_grpc_request_s_adapter_reaches_the_worker_request():
    req = router_pb2.RouterServiceGenerateRequest(text="hi", lora_path="sql", stream=True)
    out = convert.worker_request(req, "r1", [1, 2], "t")
    assert (out.lora_path, out.request_id, list(out.input_ids), out.tenant, out.stream) == ("sql", "r1", [1, 2], "t",
                                                                                            True)
    by_model = router_pb2.RouterServiceGenerateRequest(model="org/llama:8b:chat", input_ids={"ids": [1]})
    assert convert.worker_request(by_model, "r2", [1], "", "chat").lora_path == "chat"
    assert convert.worker_request(router_pb2.RouterServiceGenerateRequest(), "r3", [1], "").lora_path == ""
    with pytest.raises(ValueError, match="name different LoRA adapters"):
        convert.worker_request(router_pb2.RouterServiceGenerateRequest(lora_path="sql", model="x:chat"), "r", [1],
                               "", "chat")


@pytest.mark.parametrize("body, param", [
    ({"lora_path": "/a"}, "lora_name"), ({"lora_name": "a"}, "lora_path"), ({"lora_name": " ", "lora_path": "/a"},
                                                                             "lora_name"),
    ({"lora_name": 3, "lora_path": "/a"}, "lora_name"), ({"lora_name": "x" * 300, "lora_path": "/a"}, "lora_name"),
    ({"lora_name": "org/llama:8b", "lora_path": "/a"}, "lora_name"),
    ({"lora_name": "a", "lora_path": "/a", "pinned": "yes"}, "pinned"),
    ({"lora_name": "a", "lora_path": "/a", "lora_id": "1"}, None), (["a"], None)])
def test_bad_load_bodies_are_400s_naming_the_field(body, param):
    with pytest.raises(OpenAIError) as err:
        parse_load(body, SERVED)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_good_bodies():
    assert parse_load({"lora_name": "sql", "lora_path": "/a/sql", "pinned": True}, SERVED) == ("sql", "/a/sql")
    assert parse_unload({"lora_name": "sql"}) == "sql"
    with pytest.raises(OpenAIError):
        parse_unload({"lora_name": "sql", "lora_path": "/a"})


def _worker(url: str, mode: str = "null"):
    return SimpleNamespace(url=url, info=worker_pb2.GetModelInfoResponse(disaggregation_mode=mode))


def test_a_failed_change_names_each_worker_and_its_status_says_whose_fault():
    refused = Outcome(_worker("p:1", "prefill"), code=grpc.StatusCode.INVALID_ARGUMENT, details="rank 16 > 8")
    taken = Outcome(_worker("d:2", "decode"), code=grpc.StatusCode.ALREADY_EXISTS, details="already loaded")
    late = Outcome(_worker("c:3"), code=grpc.StatusCode.DEADLINE_EXCEEDED, details="Deadline Exceeded")
    down = Outcome(_worker("c:4"), code=grpc.StatusCode.UNAVAILABLE, details="connection refused")
    e = _failure("LoRA adapter 'x' not loaded", [refused, taken], ["undone on c:3"])
    assert e.status == 400 and e.message == ("LoRA adapter 'x' not loaded: worker p:1 (prefill): rank 16 > 8; worker "
                                             "d:2 (decode): already loaded; undone on c:3")
    assert _failure("x", [refused, late], []).status == 504
    assert _failure("x", [down], []).status == 503 and "worker c:4 (colocated): connection refused" in \
        _failure("x", [down], []).message
    assert late.unsure and down.unsure and not refused.unsure


def test_a_poll_sent_before_a_change_does_not_undo_it():
    state = LoraState()
    adapter = worker_pb2.LoraAdapter(lora_name="sql", lora_path="/a/sql")
    state.polled(worker_pb2.ListLoraAdaptersResponse(enabled=True, adapters=[adapter]), state.epoch)
    assert state.enabled and state.adapters == {"sql": "/a/sql"}
    asked_at = state.epoch
    state.changed([])  # an unload answered while the poll was on its way
    state.polled(worker_pb2.ListLoraAdaptersResponse(enabled=True, adapters=[adapter]), asked_at)
    assert state.adapters == {}
    state.polled(worker_pb2.ListLoraAdaptersResponse(enabled=True), state.epoch)
    assert state.adapters == {}


def test_cache_aware_routing_is_per_adapter():
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=32, balance_rel_threshold=1.0001,
                        max_tree_tokens=1 << 16)
    workers = [SimpleNamespace(url=u, in_flight=0) for u in ("a", "b")]
    prompt = list(range(8 * BLOCK))
    home = policy.pick(workers, prompt)
    assert policy.pick(workers, prompt) is home and policy.last_reason == "cache_hit"
    policy.pick(workers, prompt, cache_namespace("", "sql"))  # the base model's KV is no use to adapter sql
    assert policy.last_reason == "cache_miss" and policy.last_matched_tokens == 0
    assert block_keys(prompt, cache_namespace("", "sql")) != block_keys(prompt, cache_namespace("", "chat"))
    assert block_keys(prompt) == block_keys(prompt, "")


def test_namespaced_keys_are_the_same_in_every_process():
    """Sibling router processes share their routes' keys: no per-process str hash seed may enter them."""
    code = ("from radixmesh.services.router.policies import block_keys; "
            "print(block_keys(list(range(40)), 't\\x00lora:sql'))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outs) == 1 and outs.pop().strip() == str(block_keys(list(range(40)), "t\x00lora:sql"))
