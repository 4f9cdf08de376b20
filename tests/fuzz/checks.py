"""Sends the fuzz requests and checks every answer: never a 5xx, always an answer within the client's timeout (no
hang), a status the OpenAPI document lists for that operation, strict JSON (no NaN or Infinity) wherever JSON is
answered, an OpenAI error object with a message for every 4xx, a request body the document's schema accepts for
every request served, and for valid requests a 200 whose outputs respect what was asked (choices per prompt and
sample, none aborted, tokens per sample, embeddings of the asked dimensions, streams ending with [DONE])."""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import http.client
import json
import math
import re
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import jsonschema

from radixmesh.services.router.openapi import document
from tests.fuzz.request import Req

CLIENT_TIMEOUT_S = 30.0
_DOC = document()
_TEMPLATES = [(re.compile("^" + re.sub(r"\{[^}]+\}", ".+", p) + "$"), p) for p in _DOC["paths"]]
OPEN_PATHS = {"/health", "/liveness", "/readiness", "/metrics"}


def _body_validators() -> dict[str, jsonschema.Draft202012Validator]:
    """Path -> a validator of the request body the document gives its POST operation."""
    out = {}
    for path, item in _DOC["paths"].items():
        body = item.get("post", {}).get("requestBody")
        if body is not None:
            schema = body["content"]["application/json"]["schema"]
            out[path] = jsonschema.Draft202012Validator({**schema, "components": _DOC["components"]})
    return out


_BODIES = _body_validators()


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes
    elapsed_s: float


def _reject(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def strict_json(raw: bytes) -> Any:
    """JSON as RFC 8259 has it: NaN, Infinity and -Infinity are refused."""
    return json.loads(raw, parse_constant=_reject)


def documented(method: str, path: str) -> set[int]:
    """The statuses the OpenAPI document allows for `method` on `path` (a wrong method: 405; an unknown path: 404;
    both may also be a 401 before routing matters)."""
    plain = urllib.parse.unquote(urllib.parse.urlsplit(path).path)
    for pattern, template in _TEMPLATES:
        if pattern.match(plain):
            op = _DOC["paths"][template].get(method.lower())
            return {int(code) for code in op["responses"]} if op else {401, 405}
    return {401, 404, 405}


class Fuzzer:
    """Sends requests to the router on 127.0.0.1:`port`; counts them and their statuses."""

    def __init__(self, port: int):
        self.port = port
        self.statuses: collections.Counter[int] = collections.Counter()
        self.slowest = (0.0, "")
        self.hung_up = 0
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(8)

    @property
    def sent(self) -> int:
        return sum(self.statuses.values()) + self.hung_up

    def close(self) -> None:
        self._pool.shutdown()

    def _hang_up(self, req: Req) -> None:
        """Sends `req` and resets the connection (SO_LINGER 0: an RST, as a client that went away), at once or
        after the first bytes of the answer."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=CLIENT_TIMEOUT_S)
        try:
            conn.request(req.method, req.path, body=req.encoded(), headers=req.headers)
            if req.hang_up != "at once":
                conn.sock.recv(1)
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        finally:
            conn.close()
        with self._lock:
            self.hung_up += 1

    def send(self, req: Req) -> Answer:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=CLIENT_TIMEOUT_S)
        started = time.monotonic()
        try:
            conn.request(req.method, req.path, body=req.encoded(), headers=req.headers)
            resp = conn.getresponse()
            body = resp.read()
        except (socket.timeout, TimeoutError):
            raise AssertionError(f"no answer within {CLIENT_TIMEOUT_S:g} s (a hang): {req.show()}") from None
        except (ConnectionError, http.client.HTTPException) as e:
            raise AssertionError(f"the connection failed ({e!r}): {req.show()}") from None
        finally:
            conn.close()
        elapsed = time.monotonic() - started
        answer = Answer(resp.status, resp.getheader("Content-Type", ""), body, elapsed)
        with self._lock:
            self.statuses[resp.status] += 1
            if elapsed > self.slowest[0]:
                self.slowest = (elapsed, req.show(200))
        return answer

    def run_all(self, reqs: list[Req]) -> None:
        """Sends `reqs` at once (one thread each) and checks every answer."""
        for future in [self._pool.submit(self.run, r) for r in reqs]:
            future.result()

    def run(self, req: Req) -> Answer | None:
        """Sends `req` and checks the answer; AssertionError (with the request to reproduce it) on a violation."""
        if req.hang_up:
            return self._hang_up(req)
        answer = self.send(req)
        try:
            _check(req, answer)
        except (AssertionError, ValueError, KeyError, TypeError) as e:
            raise AssertionError(f"{type(e).__name__}: {e}\n  request: {req.show()}\n  answer: {answer.status} "
                                 f"{answer.body[:600]!r}") from None
        return answer


def _check(req: Req, answer: Answer) -> None:
    assert answer.status < 500, "a server error"
    assert answer.elapsed_s < CLIENT_TIMEOUT_S, "too slow"
    assert answer.status in documented(req.method, req.path), "a status the OpenAPI document does not list"
    if req.ok:
        assert answer.status == 200, "a valid request was refused"
    elif req.expect is not None:
        assert answer.status == req.expect, f"expected {req.expect}"
    if _served(req, answer) and req.path in _BODIES:
        errors = list(_BODIES[req.path].iter_errors(json.loads(req.encoded())))  # the body as the server read it
        assert not errors, f"served, but the OpenAPI document refuses it: {errors[0].message[:300]}"
    if req.method == "HEAD":
        assert answer.body == b"", "a HEAD answer with a body"
    else:
        _check_body(req, answer)


def _served(req: Req, answer: Answer) -> bool:
    """A POST with a JSON body answered 200, and not with a stream that carries an error event (a streamed batch
    whose prompt a worker refused: the request was not served)."""
    if answer.status != 200 or req.method != "POST" or req.body is None:
        return False
    return not (answer.content_type.startswith("text/event-stream") and b'data: {"error":' in answer.body)


def _check_body(req: Req, answer: Answer) -> None:
    if 400 <= answer.status < 500:
        assert answer.content_type.startswith("application/json"), answer.content_type
        error = strict_json(answer.body)["error"]
        assert isinstance(error["message"], str) and error["message"].strip(), error
        assert isinstance(error["type"], str) and error["type"], error
        return
    if answer.content_type.startswith("text/event-stream"):
        events = [line[6:] for line in answer.body.split(b"\n") if line.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", events[-2:]
        for event in events[:-1]:
            assert "error" not in strict_json(event) or not req.ok, event
        if req.ok:
            _check_output(req, [strict_json(e) for e in events[:-1]], stream=True)
    elif answer.content_type.startswith("application/json"):
        out = strict_json(answer.body)
        if req.ok:
            _check_output(req, out, stream=False)


def _samples(req: Req) -> tuple[int, int]:
    """(how many samples the request asks for, the most tokens each may have), for the generation endpoints."""
    body = req.body
    if req.path == "/generate":
        prompts = body.get("text", body.get("input_ids"))
        count = len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)) else 1
        sp = body["sampling_params"]
        sps = sp if isinstance(sp, list) else [sp] * count
        return sum(s.get("n", 1) for s in sps), max(s["max_new_tokens"] for s in sps)
    prompts = body.get("prompt")
    count = len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)) else 1
    return count * body.get("n", 1), body.get("max_tokens", body.get("max_completion_tokens"))


def _check_output(req: Req, out: Any, stream: bool) -> None:
    if req.path == "/generate":
        samples, cap = _samples(req)
        if stream:
            finals = [e for e in out if e["meta_info"]["finish_reason"] is not None]
            assert len({e.get("index", 0) for e in finals}) == samples, (samples, finals[:2])
        else:
            finals = out if isinstance(out, list) else [out]
            assert len(finals) == samples, (samples, len(finals))
        assert all(len(e["output_ids"]) <= cap for e in finals), (cap, finals[:2])
        assert all(e["meta_info"]["finish_reason"]["type"] != "abort" for e in finals), finals[:2]
    elif req.path in ("/v1/completions", "/v1/chat/completions"):
        samples, cap = _samples(req)
        chunks = out if stream else [out]
        choices = [c for chunk in chunks for c in chunk.get("choices", []) if c.get("finish_reason") is not None]
        assert sorted(c["index"] for c in choices) == list(range(samples)), (samples, choices[:2])
        assert all(c["finish_reason"] != "abort" for c in choices), choices[:2]
        usage = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
        if usage:
            assert usage[-1]["completion_tokens"] <= samples * cap, (usage[-1], samples, cap)
    elif req.path == "/v1/embeddings":
        inputs = req.body["input"]
        count = len(inputs) if isinstance(inputs, list) and isinstance(inputs[0], (str, list)) else 1
        assert [d["index"] for d in out["data"]] == list(range(count)), out["data"][:2]
        for d in out["data"]:
            _check_embedding(d["embedding"], req.body.get("dimensions"))
    elif req.path == "/encode":
        value = req.body.get("text", req.body.get("input_ids"))
        batch = isinstance(value, list) and isinstance(value[0], (str, list))
        assert isinstance(out, list) == batch, out
        assert len(out if batch else [out]) == (len(value) if batch else 1)
        for item in out if batch else [out]:
            _check_embedding(item["embedding"], req.body.get("dimensions"))


def _check_embedding(values: list[float] | str, dims: int | None) -> None:
    """An L2-normalised vector of `dims` numbers (any length without), as floats or base64 little-endian float32."""
    if isinstance(values, str):
        raw = base64.b64decode(values)
        values = list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert dims is None or len(values) == dims, (len(values), dims)
    assert math.isclose(math.fsum(v * v for v in values), 1.0, rel_tol=1e-3), values[:4]
