"""Prefill/decode disaggregation end to end: `radixmesh serve --disaggregation pd` with real processes and the
Mooncake transfer engine over TCP on loopback. Outputs (and logprobs) are token-identical to the colocated mesh's
through the `openai` client, n > 1 samples included (the router runs one pair per sample); 2 prefill + 2 decode
workers serve 100 concurrent requests; killing a prefill or a decode worker mid-transfer and corrupted or dropped
writes free every page and never stream a wrong token; an embedding model's PD mesh embeds as the colocated one; a
decode worker whose KV cache holds another dtype is refused with the reason."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import time

import grpc
import openai
import pytest

from radixmesh.services.launch import free_port
from tests.conftest import model_path
from tests.e2e.conftest import MODEL
from tests.e2e.mesh import (NOT_FORKED, REPO, cmdline, http_get, launch, loads, openai_client, running_mesh,
                             stop_and_check)
from tests.e2e.test_mesh_faults import post

NAME = model_path(MODEL)
EMBED = model_path("tiny-qwen3-embed")
GREEDY = {"temperature": 0.0}
PD = ("--disaggregation", "pd", "--disaggregation-transfer-backend", "mooncake", "--disaggregation-verify-kv")
SHARED = "The history of the lighthouse keepers on the northern coast is long and full of storms. "


def workers(mesh) -> dict[str, list[str]]:
    """Role ("prefill" | "decode") -> gRPC addresses of the mesh's workers (read from their command lines)."""
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for pid in mesh.services().values():
        argv = cmdline(pid).split()
        if "radixmesh.services.worker" in argv and "--disaggregation-mode" in argv:
            role = argv[argv.index("--disaggregation-mode") + 1]
            out[role].append(f"127.0.0.1:{argv[argv.index('--port') + 1]}")
    return out


def pid_of(mesh, address: str) -> int:
    port = address.rpartition(":")[2]
    return next(pid for pid in mesh.services().values() if f"--port {port} " in cmdline(pid) + " ")


def assert_all_freed(addresses: list[str], timeout: float = 20.0) -> None:
    """Every page free or evictable (available_kv_tokens back to the maximum) and no room left, on each worker."""
    deadline = time.monotonic() + timeout
    while True:
        got = {a: loads(a) for a in addresses}
        busy = {a: (g.used_kv_tokens, g.num_prealloc_rooms, g.num_transfer_rooms, g.num_prealloc_waiting,
                    g.num_running_requests) for a, g in got.items()}
        if all(v == (0, 0, 0, 0, 0) for v in busy.values()):
            return
        assert time.monotonic() < deadline, f"pages or rooms still held: {busy}"
        time.sleep(0.2)


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        return dict(item.decode().split("=", 1) for item in fh.read().split(b"\0") if b"=" in item)


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


@contextlib.contextmanager
def decode_worker_in_place(pd, tmp_path, flags: dict[str, str]):
    """A copy of `pd`'s first decode worker with `flags` set (replaced, or added), in the router in place of every
    decode worker the mesh started; yields its address. `pd` must be launched NOT_FORKED: the copy starts from the
    old worker's command line and /proc environ."""
    old = workers(pd)["decode"]
    first = pid_of(pd, old[0])
    argv, port = cmdline(first).split(), free_port()
    flags = {"--port": str(port), "--stream-lane-port": "0", **flags}  # (the launcher gave the old one a fixed lane)
    for flag, value in flags.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    with open(tmp_path / f"decode-{port}.log", "w") as log:
        extra = subprocess.Popen(argv, cwd=REPO, env=_environ(first), stdout=log, stderr=subprocess.STDOUT)
    try:
        assert _wait(lambda: post(f"{pd.url}/add_worker?url=127.0.0.1:{port}", b"")[0] == 200, 120)
        info = json.loads(http_get(pd.url + "/get_server_info")[1])
        for url in [w["url"] for w in info["workers"] if any(w["url"].endswith(a) for a in old)]:
            assert post(f"{pd.url}/remove_worker?url={url}", b"")[0] == 200
        yield f"127.0.0.1:{port}"
    finally:
        extra.terminate()
        extra.wait(30)


def assert_pair_refused(pd, addresses: list[str], words: str) -> None:
    """A request through `pd` fails with an error naming `words`, and `addresses` (the pair's workers) hold nothing."""
    status, raw = post(pd.url + "/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 4})
    assert status >= 400 and words.encode() in raw, (status, raw)
    assert_all_freed(addresses)


@pytest.fixture(scope="module")
def pd_mesh(tmp_path_factory):
    with running_mesh(NAME, tmp_path_factory.mktemp("pd"), *PD, "--num-prefill", "2", "--num-decode", "2") as m:
        yield m


_client = openai_client


def _prompts() -> list[str]:
    """Different lengths, several sharing long prefixes (so both prefix caches get hits)."""
    return [SHARED * k + tail for k in (1, 3, 6) for tail in ("Who kept them?", "What did they eat in winter?")] + \
        ["Hi", "Tell me a story about a cat.", SHARED * 10]


def _completion(client, prompt: str, stream: bool) -> tuple[str, list, list]:
    """(text, tokens, token logprobs with top-3), streamed or not."""
    kwargs = dict(model=NAME, prompt=prompt, max_tokens=12, logprobs=3, **GREEDY)
    if not stream:
        c = client.completions.create(**kwargs).choices[0]
        return c.text, c.logprobs.tokens, c.logprobs.token_logprobs + [sorted(t.items()) for t in c.logprobs.top_logprobs]
    text, tokens, lps, tops = "", [], [], []
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                tops += [sorted(t.items()) for t in c.logprobs.top_logprobs]
    return text, tokens, lps + tops


def _close(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return abs(a - b) < 1e-4
    return a == b


def test_pd_matches_the_colocated_mesh_through_the_openai_client(pd_mesh, mesh):
    with _client(pd_mesh) as pd, _client(mesh) as colocated:
        for stream in (False, True):
            for prompt in _prompts():
                got, want = _completion(pd, prompt, stream), _completion(colocated, prompt, stream)
                assert got[0] == want[0] and got[1] == want[1], (prompt[-40:], got[:2], want[:2])
                assert _close(got[2], want[2]), prompt[-40:]
        messages = [{"role": "user", "content": SHARED * 2 + "Summarize."}]
        kw = dict(model=NAME, messages=messages, max_tokens=16, logprobs=True, top_logprobs=2, **GREEDY)
        a, b = pd.chat.completions.create(**kw), colocated.chat.completions.create(**kw)
        assert a.choices[0].message.content == b.choices[0].message.content
        assert _close([t.logprob for t in a.choices[0].logprobs.content],
                      [t.logprob for t in b.choices[0].logprobs.content])
        assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert_all_freed(sum(workers(pd_mesh).values(), []))


def test_pd_serves_prompt_lists_and_constrained_tool_calls_as_colocated_does(pd_mesh, mesh):
    """A list of prompts and tool_choice="required" (the router's parts of issue 14) give the colocated answers."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["k"],
        "additionalProperties": False}}}
    with _client(pd_mesh) as pd, _client(mesh) as colocated:
        kw = dict(model=NAME, prompt=["The lighthouse", "A storm came"], max_tokens=8, **GREEDY)
        assert [c.text for c in pd.completions.create(**kw).choices] == [
            c.text for c in colocated.completions.create(**kw).choices]
        kw = dict(model=NAME, messages=[{"role": "user", "content": "Pick one."}], tools=[tool],
                  tool_choice="required", parallel_tool_calls=False, max_tokens=128, **GREEDY)
        a, b = pd.chat.completions.create(**kw).choices[0], colocated.chat.completions.create(**kw).choices[0]
        assert a.finish_reason == "tool_calls" and a.message.tool_calls[0].function.name == "pick"
        assert a.message.tool_calls[0].function.arguments == b.message.tool_calls[0].function.arguments
    assert_all_freed(sum(workers(pd_mesh).values(), []))


def _concurrent_texts(url: str, prompts: list[str]) -> list[str]:
    """Every prompt's greedy 10-token completion, all sent at once."""
    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
            outs = await asyncio.gather(*(c.completions.create(model=NAME, prompt=p, max_tokens=10, **GREEDY)
                                          for p in prompts))
        return [o.choices[0].text for o in outs]
    return asyncio.run(run())


def test_two_prefill_two_decode_serve_100_concurrent_requests(pd_mesh, mesh):
    prompts = [f"{SHARED * (i % 5)}Question {i}: what is {i} plus {i % 7}?" for i in range(100)]
    got, want = _concurrent_texts(pd_mesh.url, prompts), _concurrent_texts(mesh.url, prompts)
    assert got == want
    roles = workers(pd_mesh)
    assert len(roles["prefill"]) == 2 and len(roles["decode"]) == 2
    assert_all_freed(roles["prefill"] + roles["decode"])
    gbps = [loads(a).kv_transfer_gbps for a in roles["prefill"]]
    assert all(g > 0 for g in gbps), gbps  # both prefill workers moved KV


def test_the_shm_backend_moves_kv_between_workers_of_one_host_and_leaves_nothing_in_dev_shm(tmp_path, mesh):
    """--disaggregation-transfer-backend shm: the decode worker's mirror is in shared-memory files the prefill worker
    maps; answers match the colocated mesh's (with --disaggregation-verify-kv), every page is freed, and once the
    mesh stops no file of it is left."""
    before = set(os.listdir("/dev/shm"))
    flags = ("--disaggregation", "pd", "--disaggregation-transfer-backend", "shm", "--disaggregation-verify-kv")
    prompts = [f"{SHARED * (i % 4)}Question {i}: what is {i} plus {i % 7}?" for i in range(24)]
    with running_mesh(NAME, tmp_path, *flags) as pd:
        made = {f for f in set(os.listdir("/dev/shm")) - before if f.startswith("radixmesh-lasting-")}
        # the decode worker's mirror (peers write into it) and both workers' indexes; the prefill worker's mirror
        # is private memory
        mirror_pids = {f.rsplit("-", 2)[1] for f in made if "kv-mirror" in f}
        assert len(mirror_pids) == 1 and sum("kv-shm-index" in f for f in made) == 2, made
        assert _concurrent_texts(pd.url, prompts) == _concurrent_texts(mesh.url, prompts)
        roles = workers(pd)
        assert_all_freed(roles["prefill"] + roles["decode"])
        assert all(loads(a).kv_transfer_gbps > 0 for a in roles["prefill"])
    assert not made & set(os.listdir("/dev/shm"))


SAMPLED = dict(n=3, temperature=0.8, seed=1234, max_tokens=12)


def _sampled_choices(client, kind: str, stream: bool) -> tuple[list[tuple[int, str, str]], tuple | None]:
    """(index, text, finish_reason) of each choice of an n=3 seeded request, by index (streamed: reassembled per
    index), and the usage (prompt, completion tokens) of the whole answer."""
    if kind == "chat":
        kw = dict(model=NAME, messages=[{"role": "user", "content": SHARED + "Tell me more."}], **SAMPLED)
        make, text_of = client.chat.completions.create, (lambda c: c.message.content if not stream else
                                                         c.delta.content)
    else:
        kw = dict(model=NAME, prompt=SHARED * 2 + "Once", **SAMPLED)
        make, text_of = client.completions.create, (lambda c: c.text)
    if not stream:
        out = make(**kw)
        return sorted((c.index, c.text if kind != "chat" else c.message.content, c.finish_reason)
                      for c in out.choices), (out.usage.prompt_tokens, out.usage.completion_tokens)
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in make(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (text_of(c) or "")
            if c.finish_reason:
                assert c.index not in finish, c.index  # one finish per sample
                finish[c.index] = c.finish_reason
    return sorted((i, texts[i], finish.get(i)) for i in texts), None


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_pd_n_samples_match_the_colocated_mesh(pd_mesh, mesh, kind):
    """n=3 with a seed through the openai client: sample j runs as its own pair with seed + j, the prompt prefilled
    once; the choices (text, index, finish_reason) are the colocated mesh's, whole and streamed."""
    with _client(pd_mesh) as pd, _client(mesh) as colocated:
        for stream in (False, True):
            got, want = _sampled_choices(pd, kind, stream), _sampled_choices(colocated, kind, stream)
            assert [c[0] for c in got[0]] == [0, 1, 2] and all(c[2] for c in got[0]), got
            assert got == want, (stream, got, want)
            assert len({c[1] for c in got[0]}) > 1, got  # the samples differ (seed + j)
    assert_all_freed(sum(workers(pd_mesh).values(), []))


def _native(mesh, stream: bool) -> list[dict]:
    """SGLang /generate with n=2: the final dict of each sample (streamed: the last event of each index)."""
    body = {"text": SHARED + "The keeper said", "rid": "pd-n2", "stream": stream,
            "sampling_params": {"n": 2, "temperature": 0.8, "sampling_seed": 1234, "max_new_tokens": 12}}
    status, raw = post(mesh.url + "/generate", body, headers=None, timeout=120)
    assert status == 200, raw
    if not stream:
        results = json.loads(raw)
    else:
        last: dict[int, dict] = {}
        for line in raw.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                last[event.pop("index")] = event
        assert sorted(last) == [0, 1], sorted(last)
        results = [last[i] for i in sorted(last)]
    return [{"text": r["text"], "output_ids": r["output_ids"],
             **{k: r["meta_info"][k] for k in ("id", "finish_reason", "prompt_tokens", "completion_tokens")}}
            for r in results]


def test_pd_native_generate_with_n_2_matches_the_colocated_mesh(pd_mesh, mesh):
    for stream in (False, True):
        got, want = _native(pd_mesh, stream), _native(mesh, stream)
        assert [g["id"] for g in got] == ["pd-n2-0", "pd-n2-1"], got
        assert got == want, (stream, got, want)
    assert_all_freed(sum(workers(pd_mesh).values(), []))


def _embeddings(mesh) -> list:
    texts = ["Hello there, how are you?", SHARED, "東京 is a city 🙂"]
    with openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        out = [c.embeddings.create(model=EMBED, input=texts, encoding_format="float"),
               c.embeddings.create(model=EMBED, input=[[40, 41, 42, 43], [300, 7]], dimensions=32)]
    return [([d.index for d in r.data], [d.embedding for d in r.data], r.usage.prompt_tokens) for r in out]


def test_pd_embeddings_match_the_colocated_mesh(tmp_path, embed_mesh):
    """An embedding model in a PD mesh: /v1/embeddings go to a prefill worker (a prefill forward with nothing to
    hand over) and equal the colocated mesh's answer within 1e-5 (embed_mesh: the same flags without PD)."""
    answers = [_embeddings(embed_mesh)]
    m = launch(EMBED, tmp_path, "--is-embedding", "--page-size", "4", *PD, "--num-prefill", "1", "--num-decode", "1")
    try:
        answers.append(_embeddings(m))
        assert_all_freed(sum(workers(m).values(), []))
    finally:
        stop_and_check(m)
    for (pd_index, pd_vectors, pd_tokens), (index, vectors, tokens) in zip(*answers):
        assert pd_index == index and pd_tokens == tokens
        assert [len(v) for v in pd_vectors] == [len(v) for v in vectors]
        assert max(abs(a - b) for u, v in zip(pd_vectors, vectors) for a, b in zip(u, v)) < 1e-5


def _generate(mesh, stream: bool = False, max_tokens: int = 8) -> tuple[int, bytes]:
    body = {"model": NAME, "prompt": SHARED * 4, "max_tokens": max_tokens, **GREEDY, "stream": stream}
    return post(mesh.url + "/v1/completions", body, headers=None, timeout=120)


def _wait_transferring(addresses: list[str], timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for a in addresses:
            if loads(a).num_transfer_rooms:
                return a
        time.sleep(0.02)
    raise AssertionError("no worker reached the transferring state")


def _log_since(m, offset: int) -> str:
    """What the mesh logged after its log had `offset` bytes."""
    with open(m.log_path, "rb") as fh:
        fh.seek(offset)
        return fh.read().decode(errors="replace")


def _client_leaves_mid_transfer(m, roles: dict[str, list[str]], logged: int) -> None:
    """A streaming client hangs up while its KV is on the way (each write waits 2 s). The decode worker cannot free
    pages a write may still fill, but it hears when the write returned: every page is free a few seconds later, well
    before its 10 s transfer timeout would end a blind wait. `logged`: the log's size before."""
    host, port = m.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": SHARED * 5, "max_tokens": 8,
                                                        "stream": True, **GREEDY}),
                 {"Content-Type": "application/json"})
    _wait_transferring(roles["decode"])
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    left = time.monotonic()
    assert_all_freed(roles["prefill"] + roles["decode"], timeout=7.0)
    assert time.monotonic() - left < 7.0
    assert "pages pinned until the prefill worker's write returns" in _log_since(m, logged)


def _answering(addresses: list[str], timeout: float = 90.0) -> None:
    """Until every worker answers GetLoads (one killed by an earlier test is back once the launcher restarted it)."""
    deadline = time.monotonic() + timeout
    for a in addresses:
        while True:
            try:
                loads(a)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, f"{a} does not answer"
                time.sleep(0.2)


@pytest.fixture(scope="module")
def slow_pd(tmp_path_factory):
    """Two prefill and two decode workers whose every KV write waits 2 s (injected): a kill lands while the room is
    transferring. Both kill tests share it: whichever role dies, the other pair of that role is there to retry on."""
    with running_mesh(NAME, tmp_path_factory.mktemp("slow-pd"), *PD, "--num-prefill", "2", "--num-decode", "2",
                      "--disaggregation-inject-fault", "delay:2", "--disaggregation-transfer-timeout", "10") as m:
        yield m


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_killing_a_worker_mid_transfer_frees_the_room_and_the_request_is_retried(slow_pd, victim, mesh):
    """Each write waits 2 s (injected), so the kill lands while the room is transferring. The request moves to
    another pair and completes correctly; the survivors hold no page and no room."""
    m = slow_pd
    roles = workers(m)
    _answering(roles["prefill"] + roles["decode"])
    logged = m.log_path.stat().st_size  # what this test logs comes after
    if victim == "decode":
        _client_leaves_mid_transfer(m, roles, logged)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_generate, m)
        hit = _wait_transferring(roles[victim])
        os.kill(pid_of(m, hit), signal.SIGKILL)
        t = time.monotonic()
        status, raw = pending.result(timeout=60)
    assert status == 200, raw
    assert time.monotonic() - t < 15  # a retry on another pair, not a hang
    want = _generate(mesh)
    assert json.loads(raw)["choices"][0]["text"] == json.loads(want[1])["choices"][0]["text"]
    assert_all_freed([a for a in roles["prefill"] + roles["decode"] if a != hit])
    failed = [line for line in _log_since(m, logged).splitlines() if "radixmesh.pd: room" in line and "failed" in line]
    assert failed, m.log_tail(100)  # the broken room is logged with its room number and request id


@pytest.mark.parametrize("fault,words", [("corrupt", "checksum mismatch"), ("drop", "injected drop")])
def test_corrupted_or_dropped_transfers_are_caught_and_reported(tmp_path, fault, words):
    m = launch(NAME, tmp_path, *PD, "--num-prefill", "1", "--num-decode", "1", "--disaggregation-inject-fault",
               fault)
    try:
        for stream in (False, True):  # streamed too: the error comes before any token, as an HTTP error
            status, raw = _generate(m, stream=stream)
            assert status == 503, raw
            assert words in json.loads(raw)["error"]["message"], raw
        roles = workers(m)
        assert_all_freed(roles["prefill"] + roles["decode"])
    finally:
        stop_and_check(m)


def test_a_decode_worker_whose_kv_cache_means_other_bytes_is_refused(tmp_path):
    """fp8_e4m3 and fp8_e5m2 pages have the same size, so a handoff that compared only sizes moved them and the
    decode worker read every key and value wrong. The decode worker says what its cache holds (dtype and scales); a
    prefill worker whose cache differs refuses the room with the reason, and neither holds a page after."""
    with running_mesh(NAME, tmp_path, *PD, "--kv-cache-dtype", "fp8_e4m3", env=NOT_FORKED) as pd:
        status, raw = _generate(pd)
        assert status == 200, raw  # (the fp8_e4m3 pair serves)
        roles = workers(pd)
        with decode_worker_in_place(pd, tmp_path, {"--kv-cache-dtype": "fp8_e5m2"}) as decode:
            assert_pair_refused(pd, roles["prefill"] + [decode], "same --kv-cache-dtype and KV cache scales")
