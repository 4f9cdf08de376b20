"""Failure handling of the launched mesh, end to end with real processes: one OS process per service, a worker
killed under load and replaced through /add_worker, bad input answered with OpenAI error objects (and the mesh
still serving after a flood of it), SIGTERM with streams open, and a client disconnect freeing the worker's KV."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.services.launch import free_port
from tests.conftest import model_path
from tests.e2e.mesh import NOT_FORKED, REPO, alive, http_get, launch, stop_and_check

MODEL = model_path("tiny-llama")  # also the served model name (the workers default to the model path)
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 1024  # tiny-llama's context length
PROMPT = "The capital of France is"
GREEDY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0}


# ---- HTTP helpers ---------------------------------------------------------------------------------------------
def post(url: str, body, headers: dict | None = AUTH, timeout: float = 60.0) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post_json(url: str, body, headers: dict | None = AUTH) -> dict:
    status, raw = post(url, body, headers)
    assert status == 200, raw
    return json.loads(raw)


def assert_error(status: int, raw: bytes, want_status: int, *words: str) -> dict:
    """An OpenAI error object with `want_status`, its message naming each of `words`."""
    assert status == want_status, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and isinstance(err["type"], str) and err["type"], err
    for w in words:
        assert w.lower() in err["message"].lower(), (w, err)
    return err


class Stream:
    """One streamed HTTP request read event by event (SSE `data:` lines), every read bounded by `timeout`."""

    def __init__(self, port: int, path: str, body: dict, headers: dict | None = None, timeout: float = 30.0):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.conn.request("POST", path, body=json.dumps(body),
                          headers={"Content-Type": "application/json", **(headers or {})})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        self.events: list[str] = []

    def next_event(self) -> str | None:
        while line := self.resp.readline():  # chunked transfer decoded; b"" at the end of the body
            if line.startswith(b"data: "):
                self.events.append(line[6:].decode().strip())
                return self.events[-1]
        return None

    def read_all(self) -> list[str]:
        while self.next_event() is not None:
            pass
        return self.events

    def close(self) -> None:
        self.conn.close()


def hang_up(conn: http.client.HTTPConnection) -> None:
    """Drop the connection as a client that goes away does: RST (SO_LINGER 0), no more reads."""
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    conn.close()


def assert_stream_ended(events: list[str]) -> str:
    """A stream ends with [DONE] after either a chunk with a finish_reason or an error event; returns which."""
    assert events and events[-1] == "[DONE]", events[-3:]
    last = json.loads(events[-2])
    if "error" in last:
        assert last["error"]["message"], last
        return "error"
    assert last["choices"] and last["choices"][-1]["finish_reason"] in ("length", "stop"), last
    return "finished"


def pid_parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def grpc_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


def wait_for(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


# ---- the shared mesh (API key on); the worker-kill test goes last, it leaves the mesh on a replacement worker --
@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    # started afresh, as users run it: test_one_process_per_service checks each service is the launcher's child
    m = launch(MODEL, tmp_path_factory.mktemp("faults"), api_key=KEY, env=NOT_FORKED)
    try:
        yield m
    finally:
        stop_and_check(m)


@pytest.fixture(scope="module")
def greedy(mesh) -> dict:
    """The mesh's greedy answer to GREEDY before anything was done to it: text and token ids."""
    text = post_json(mesh.url + "/v1/completions", GREEDY)["choices"][0]["text"]
    out = post_json(mesh.url + "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 16,
                                                                                  "temperature": 0.0}})
    assert out["text"] == text and len(out["output_ids"]) == 16
    return {"text": text, "ids": out["output_ids"]}


# ---- 1. one OS process per service ----------------------------------------------------------------------------
def test_one_process_per_service(mesh):
    procs = mesh.services()
    assert sorted(procs) == ["radixmesh.services.router", "radixmesh.services.tokenizer",
                             "radixmesh.services.worker"], procs
    assert len(set(procs.values())) == 3
    for name, pid in procs.items():
        assert alive(pid) and pid_parent(pid) == mesh.proc.pid, name
    helps = {("radixmesh.services.tokenizer", "--help"): b"--model-path",
             ("radixmesh.services.worker", "--help"): b"--model-path",
             ("radixmesh.services.prefill", "--help"): b"--disaggregation-mode",
             ("radixmesh.services.router", "--help"): b"--worker-urls",
             ("radixmesh.services.launch", "serve", "--help"): b"--num-workers"}
    runs = {argv: subprocess.Popen([sys.executable, "-m", *argv], cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT) for argv in helps}
    for argv, p in runs.items():
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, (argv, out.decode()[-2000:])
        assert out.startswith(b"usage:") and helps[argv] in out, (argv, out.decode()[:500])


# ---- 3. bad input: OpenAI error objects, the mesh keeps serving ------------------------------------------------
def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


def _completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "hi", **kw}


NO_KEY: dict = {}
BAD_INPUT = {  # name: (path, body, headers, status, words the message must contain)
    "malformed_json": ("/v1/completions", b'{"model": "x", "prompt": ', AUTH, 400, ["JSON"]),
    "malformed_json_chat": ("/v1/chat/completions", b"not json", AUTH, 400, ["JSON"]),
    "body_not_object": ("/v1/completions", [1, 2], AUTH, 400, ["object"]),
    "missing_prompt": ("/v1/completions", {"model": MODEL, "max_tokens": 5}, AUTH, 400, ["prompt"]),
    "missing_messages": ("/v1/chat/completions", {"model": MODEL}, AUTH, 400, ["messages"]),
    "temperature_hot": ("/v1/completions", _completion(temperature="hot"), AUTH, 400, ["temperature", "hot"]),
    "temperature_hot_chat": ("/v1/chat/completions", _chat(temperature="hot"), AUTH, 400, ["temperature"]),
    "max_tokens_ten": ("/v1/completions", _completion(max_tokens="ten"), AUTH, 400, ["max_tokens", "ten"]),
    "n_zero": ("/v1/completions", _completion(n=0), AUTH, 400, ["'n'"]),
    "messages_not_list": ("/v1/chat/completions", _chat(messages="hello"), AUTH, 400, ["messages", "list"]),
    "unknown_model": ("/v1/completions", _completion(model="gpt-9"), AUTH, 404, ["gpt-9"]),
    "unknown_model_chat": ("/v1/chat/completions", _chat(model="gpt-9"), AUTH, 404, ["gpt-9"]),
    "prompt_ids_over_context": ("/v1/completions", _completion(prompt=[5] * 1100, max_tokens=5), AUTH, 400,
                                ["1100", "context length"]),
    "text_over_context_chat": ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "hi " * 1500}]),
                               AUTH, 400, ["context length"]),
    "max_tokens_too_large": ("/v1/completions", _completion(max_tokens=100000), AUTH, 400,
                             ["100000", "context length"]),
    "max_tokens_too_large_chat": ("/v1/chat/completions", _chat(max_tokens=100000), AUTH, 400, ["100000"]),
    "no_api_key": ("/v1/completions", _completion(), NO_KEY, 401, ["API key"]),
    "bad_api_key": ("/v1/chat/completions", _chat(), {"Authorization": "Bearer sk-wrong"}, 401, ["API key"]),
    "generate_text_and_ids": ("/generate", {"text": "hi", "input_ids": [1, 2]}, AUTH, 400, ["text", "input_ids"]),
    "generate_neither": ("/generate", {"sampling_params": {"max_new_tokens": 2}}, AUTH, 400, ["text", "input_ids"]),
    "generate_out_of_vocab": ("/generate", {"input_ids": [1, 99999]}, AUTH, 400, ["99999", "vocabulary"]),
    "generate_temperature_hot": ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, AUTH, 400,
                                 ["temperature"]),
    "generate_over_context": ("/generate", {"input_ids": [5] * 1100}, AUTH, 400, ["context length"]),
    "generate_malformed_json": ("/generate", b"{", AUTH, 400, ["JSON"]),
    "generate_no_api_key": ("/generate", {"text": "hi"}, NO_KEY, 401, ["API key"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_an_openai_error(mesh, case):
    path, body, headers, status, words = BAD_INPUT[case]
    err = assert_error(*post(mesh.url + path, body, headers), status, *words)
    assert err["type"] == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}[status]


def test_health_needs_no_key_but_the_api_does(mesh):
    assert http_get(mesh.url + "/health") == (200, b"")
    assert_error(*http_get(mesh.url + "/v1/models"), 401, "API key")
    status, raw = http_get(mesh.url + "/v1/models", AUTH)
    assert status == 200 and json.loads(raw)["data"][0]["id"] == MODEL


def test_a_flood_of_bad_requests_leaves_the_mesh_serving(mesh, greedy):
    cases = [BAD_INPUT[name] for name in sorted(BAD_INPUT)]
    flood = [cases[i % len(cases)] for i in range(100)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda c: post(mesh.url + c[0], c[1], c[2]), flood))
    for (path, _, _, status, words), answer in zip(flood, answers):
        assert_error(*answer, status, *words)
    assert all(alive(pid) for pid in mesh.known_pids)
    assert post_json(mesh.url + "/v1/completions", GREEDY)["choices"][0]["text"] == greedy["text"]
    out = post_json(mesh.url + "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 16,
                                                                                  "temperature": 0.0}})
    assert out["output_ids"] == greedy["ids"]


# ---- 5. a client that goes away frees the worker's KV pages at once ---------------------------------------------
def server_info(mesh) -> dict:
    status, raw = http_get(mesh.url + "/get_server_info", AUTH)
    assert status == 200, raw
    return json.loads(raw)


def kv_in_use(mesh) -> int:
    info = server_info(mesh)
    return info["max_total_num_tokens"] - info["available_kv_tokens"]


def flush(mesh, timeout: float) -> bool:
    """POST /flush_cache until it succeeds (it refuses while requests are in flight)."""
    return wait_for(lambda: post(mesh.url + "/flush_cache", b"")[0] == 200, timeout, interval=0.05)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_frees_kv(mesh, stream):
    assert flush(mesh, 10) and kv_in_use(mesh) == 0
    # ~1000 tokens take seconds to generate here; the KV must come back well before that
    body = _completion(prompt=PROMPT, max_tokens=CONTEXT - 24, temperature=0.0, ignore_eos=True, stream=stream)
    if stream:
        s = Stream(mesh.port, "/v1/completions", body, AUTH)
        for _ in range(3):
            assert json.loads(s.next_event())["choices"]
        conn = s.conn
    else:
        conn = http.client.HTTPConnection("127.0.0.1", mesh.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", **AUTH})
    assert wait_for(lambda: kv_in_use(mesh) > 0, 5, interval=0.02), "the request never held KV"
    hang_up(conn)
    start = time.monotonic()
    assert flush(mesh, 3), "the request kept running after its client went away"
    assert kv_in_use(mesh) == 0
    assert time.monotonic() - start < 3
    assert "unhandled error" not in mesh.log_path.read_text(errors="replace")  # a hang-up is no server error


# ---- 2. a killed worker: fast 503s, replaced through /add_worker (runs last on the shared mesh) --------------------
def test_a_failing_prompt_cancels_the_rest_of_its_batch(mesh):
    """/generate with a batch: when one prompt is rejected (the worker refuses a token id outside the vocabulary),
    the other prompt is cancelled too, so its KV comes back at once instead of after ~1000 tokens."""
    assert flush(mesh, 10) and kv_in_use(mesh) == 0
    body = {"input_ids": [list(range(20, 40)), [20, 21, 99999]],
            "sampling_params": {"max_new_tokens": CONTEXT - 64, "ignore_eos": True, "temperature": 0.0}}
    (status, raw), took = _timed(post, mesh.url + "/generate", body)
    assert_error(status, raw, 400, "99999")
    assert flush(mesh, 3), "the batch's other prompt kept generating"
    assert kv_in_use(mesh) == 0


def _timed(fn, *args):
    start = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - start


def test_hung_worker_fails_its_open_streams_within_bounds(mesh, greedy):
    """A worker that stops answering (SIGSTOP) must not hold its clients until the request deadline: new requests
    go elsewhere (503 here, the only worker) after one failed probe, open streams end with an error after three."""
    stream = Stream(mesh.port, "/v1/completions", _completion(
        prompt=PROMPT, max_tokens=CONTEXT - 24, temperature=0.0, ignore_eos=True, stream=True), AUTH, timeout=40)
    assert stream.next_event() is not None
    worker = mesh.services()["radixmesh.services.worker"]
    os.kill(worker, signal.SIGSTOP)
    try:
        (events, took) = _timed(stream.read_all)
        assert assert_stream_ended(events) == "error" and took < 30, took
        assert "stopped answering" in events[-2]
        (status, raw), took = _timed(post, mesh.url + "/v1/completions", GREEDY)
        assert_error(status, raw, 503, "worker")
        assert took < 5
    finally:
        os.kill(worker, signal.SIGCONT)
        stream.close()
    assert wait_for(lambda: http_get(mesh.url + "/health_generate", AUTH)[0] == 200, 20, 0.5)
    assert post_json(mesh.url + "/v1/completions", GREEDY)["choices"][0]["text"] == greedy["text"]


def test_removed_worker_ends_open_streams_with_an_error(mesh, greedy):
    stream = Stream(mesh.port, "/v1/completions", _completion(
        prompt=PROMPT, max_tokens=CONTEXT - 24, temperature=0.0, ignore_eos=True, stream=True), AUTH, timeout=30)
    assert stream.next_event() is not None
    url = json.loads(http_get(mesh.url + "/get_server_info", AUTH)[1])["workers"][0]["url"]
    assert post(f"{mesh.url}/remove_worker?url={url}", b"")[0] == 200
    try:
        events = stream.read_all()
        assert assert_stream_ended(events) == "error" and "removed" in events[-2]
        assert_error(*post(mesh.url + "/v1/completions", GREEDY), 503, "worker")
    finally:
        stream.close()
        assert post(f"{mesh.url}/add_worker?url={url}", b"")[0] == 200
    assert post_json(mesh.url + "/v1/completions", GREEDY)["choices"][0]["text"] == greedy["text"]


def test_killed_worker_is_replaced_through_add_worker(mesh, greedy, tmp_path):
    port = free_port()
    log = open(tmp_path / "extra-worker.log", "w")
    extra = subprocess.Popen([sys.executable, "-m", "radixmesh.services.worker", "--model-path", MODEL, "--port",
                              str(port), "--log-level", "warning"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:  # the replacement loads while the dead worker's effects are checked
        open_stream = Stream(mesh.port, "/v1/completions", _completion(
            prompt=PROMPT, max_tokens=CONTEXT - 24, temperature=0.0, ignore_eos=True, stream=True), AUTH, timeout=30)
        assert open_stream.next_event() is not None
        worker = mesh.services()["radixmesh.services.worker"]
        os.kill(worker, signal.SIGKILL)
        assert wait_for(lambda: not alive(worker), 5)

        assert assert_stream_ended(open_stream.read_all()) == "error"  # the open stream ends, with an error event
        open_stream.close()
        (status, raw), took = _timed(http_get, mesh.url + "/health_generate", AUTH)
        assert status == 503 and took < 5, raw
        assert json.loads(raw)["workers"][0]["healthy"] is False
        (status, raw), took = _timed(post, mesh.url + "/v1/completions", GREEDY)
        assert_error(status, raw, 503, "worker")
        assert took < 5
        (status, raw), took = _timed(post, mesh.url + "/generate", {"text": PROMPT})
        assert_error(status, raw, 503, "worker")
        assert took < 5
        assert mesh.proc.poll() is None, "a dead worker must not stop the launcher"

        assert wait_for(lambda: extra.poll() is not None or grpc_serving(f"127.0.0.1:{port}"), 90, 0.2)
        assert extra.poll() is None, (tmp_path / "extra-worker.log").read_text()[-2000:]
        status, raw = post(f"{mesh.url}/add_worker?url=127.0.0.1:{port}", b"")
        assert status == 200, raw
        assert post_json(mesh.url + "/v1/completions", GREEDY)["choices"][0]["text"] == greedy["text"]
        out = post_json(mesh.url + "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 16,
                                                                                      "temperature": 0.0}})
        assert out["output_ids"] == greedy["ids"]
        status, raw = http_get(mesh.url + "/health_generate", AUTH)
        assert status == 200 and any(w["healthy"] for w in json.loads(raw)["workers"]), raw
    finally:
        extra.kill()
        extra.wait()
        log.close()


# ---- 4. SIGTERM to the launcher with streams open --------------------------------------------------------------
def test_sigterm_with_open_streams(tmp_path):
    """Streams that finish within the shutdown grace period end normally; the rest end with an error event when
    the grace period is over. None is cut off or left hanging, and the launcher exits 0 leaving no process."""
    # a grace period that 15 more tokens fit in many times over and ~1000 do not: with 2 s, the eight streams once
    # streamed their ~1000 tokens in time on a quiet CI machine (a CI run), so the long ones never met the deadline
    m = launch(MODEL, tmp_path, "--shutdown-grace-s", "1")
    streams: list[Stream] = []
    try:
        lengths = [16] * 4 + [CONTEXT - 32] * 4  # ~1000 tokens take longer than the 1 s grace period here
        for i, n in enumerate(lengths):
            streams.append(Stream(m.port, "/v1/completions", {"model": MODEL, "prompt": f"Story number {i}:",
                                                               "max_tokens": n, "temperature": 0.0,
                                                               "ignore_eos": True, "stream": True}))
        for s in streams:
            assert json.loads(s.next_event())["choices"]
        m.proc.send_signal(signal.SIGTERM)
        endings = [assert_stream_ended(s.read_all()) for s in streams]
        assert endings == ["finished"] * 4 + ["error"] * 4
        assert all("shutting down" in json.loads(s.events[-2])["error"]["message"] for s in streams[4:])
        assert m.proc.wait(timeout=60) == 0, m.log_tail()
    finally:
        for s in streams:
            s.close()
        stop_and_check(m)
