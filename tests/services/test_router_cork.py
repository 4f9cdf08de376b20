"""Coalesced stream writes (services/router/cork.py), seen on the wire by a client that reads the router's chunked
HTTP responses itself: the events of worker messages that reach the router together leave in one HTTP chunk, while
tokens that come one at a time leave one at a time, as they come (nothing is held back). The events are the same
either way. Over the stream lane and over gRPC; /generate and streamed chat."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.services.test_router_resilience import KEY, Mesh, tokenizer  # noqa: F401 (fixture)

GAP_S = 0.15


def chunked_post(base: str, path: str, body: dict) -> list[tuple[float, bytes]]:
    """POST `body` and read the chunked response by hand: (arrival time, payload) of each HTTP chunk."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nAuthorization: Bearer "
                  f"{KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        f = s.makefile("rb")
        status = f.readline()
        assert b" 200 " in status, status + f.read(2000)
        headers = {}
        while (line := f.readline()) != b"\r\n":
            k, v = line.decode().split(":", 1)
            headers[k.strip().lower()] = v.strip()
        assert headers.get("transfer-encoding") == "chunked", headers
        chunks = []
        while True:
            size = int(f.readline().strip(), 16)
            payload = f.read(size)
            assert f.read(2) == b"\r\n"
            if size == 0:
                return chunks
            chunks.append((time.monotonic(), payload))


def events(chunks: list[tuple[float, bytes]]) -> list[str]:
    body = b"".join(p for _, p in chunks).decode()
    assert body.endswith("\n\n")
    return body[:-2].split("\n\n")


GENERATE = ("/generate", {"text": "hello there", "sampling_params": {"max_new_tokens": 4}, "stream": True})
CHAT = ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                 "stream": True})


def _check_events(path: str, evs: list[str]) -> None:
    assert evs[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in evs[:-1]]
    if path == "/generate":  # cumulative text, one event per token, then the finished answer
        assert [p["text"] for p in payloads] == [" tok" * i for i in range(1, 5)] + [" tok" * 4]
        assert payloads[-1]["meta_info"]["finish_reason"]["type"] == "length"
    else:  # the role chunk, a delta per token, the finish chunk
        deltas = [p["choices"][0]["delta"] for p in payloads]
        assert deltas == [{"role": "assistant", "content": ""}] + [{"content": " tok"}] * 4 + [{}]
        assert payloads[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "grpc"])
def test_queued_messages_leave_together_and_single_ones_at_once(tokenizer, tmp_path, lane):  # noqa: F811
    mesh = Mesh(tokenizer, tmp_path)
    try:
        mesh.worker("--burst")
        burst = mesh.router(*([] if lane else ["--disable-stream-lane"]))
        mesh.workers.clear()
        mesh.worker("--token-gap-s", str(GAP_S))
        paced = mesh.router(*([] if lane else ["--disable-stream-lane"]))
        for path, body in (GENERATE, CHAT):
            together = chunked_post(burst, path, body)
            _check_events(path, events(together))
            # the whole answer reached the router at once: one write, where each event used to be one
            assert len(together) <= 2, [p for _, p in together]

            apart = chunked_post(paced, path, body)
            evs = events(apart)
            _check_events(path, evs)
            assert len(apart) >= 4, [p for _, p in apart]
            # each token was written as it came: the chunks' arrival times are GAP_S apart, not bunched at the end
            token_chunks = [t for t, p in apart if b"tok" in p][:4]
            assert len(token_chunks) == 4, [p for _, p in apart]
            gaps = [b - a for a, b in zip(token_chunks, token_chunks[1:])]
            assert min(gaps) > GAP_S / 2, gaps
    finally:
        mesh.close()
