"""`python -m radixmesh.benchmarks.fake_sglang_worker --port P [--tokens N]`: an SGLang-style HTTP worker that answers
at once, for measuring SGLang's own router (sglang-router, Rust) on the workload benchmarks.router gives ours. It
serves what that router calls: /health, /health_generate, /get_server_info (/server_info), /get_model_info
(/model_info), /v1/models, /get_load, /generate (whole, or streamed as SGLang streams it: cumulative events, one per
token and one with the finish reason, then [DONE]) and /v1/chat/completions (streamed: one content delta per token, a finish chunk, [DONE]). The
answers are those of benchmarks.fake_worker (token i is id i % 1000 with text " tok"), so the benchmark's checks
hold for both routers. No model, no tokenizer: like SGLang workers, it takes text and ignores it."""

from __future__ import annotations

import argparse
import json
import time

from aiohttp import web

from radixmesh.benchmarks.fake_worker import TOKEN_TEXT, token_ids

DONE = b"data: [DONE]\n\n"


def _count(body: dict, default: int) -> int:
    params = body.get("sampling_params") or {}
    limit = params.get("max_new_tokens", body.get("max_tokens", body.get("max_completion_tokens")))
    return min(default, limit) if isinstance(limit, int) else default


def _generate_event(n_done: int, n: int, prompt: int, last: bool) -> dict:
    finish = {"type": "length", "length": n} if last else None
    return {"text": TOKEN_TEXT * n_done, "output_ids": token_ids(n_done), "meta_info": {
        "id": "fake", "prompt_tokens": prompt, "completion_tokens": n_done, "cached_tokens": 0,
        "finish_reason": finish}}


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n, prompt = _count(body, request.app["tokens"]), len(body.get("input_ids") or body.get("text", "").split())
    if not body.get("stream"):
        return web.json_response(_generate_event(n, n, prompt, True))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    # cumulative events, one per token, then one with the finish reason: the n + 1 events our router sends for the
    # fake gRPC worker's n chunks and its final chunk, so the client reads the same stream from both routers
    for i in range(1, n + 1):
        await resp.write(_event(_generate_event(i, n, prompt, False)))
    await resp.write(_event(_generate_event(n, n, prompt, True)))
    await resp.write(DONE)
    return resp


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(created: int, delta: dict, finish: str | None) -> bytes:
    return _event({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": created, "model": "fake",
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n, created = _count(body, request.app["tokens"]), int(time.time())
    if not body.get("stream"):
        return web.json_response({"id": "chatcmpl-fake", "object": "chat.completion", "created": created,
                                  "model": "fake", "choices": [{"index": 0, "finish_reason": "length", "message": {
                                      "role": "assistant", "content": TOKEN_TEXT * n}}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_chunk(created, {"role": "assistant", "content": ""}, None))
    for _ in range(n):
        await resp.write(_chunk(created, {"content": TOKEN_TEXT}, None))
    await resp.write(_chunk(created, {}, "length"))
    await resp.write(DONE)
    return resp


def app_for(tokens: int, model: str) -> web.Application:
    app = web.Application()
    app["tokens"] = tokens
    info = {"model_path": model, "tokenizer_path": model, "is_generation": True, "served_model_name": model,
            "max_total_num_tokens": 1 << 20, "dp_size": 1, "tp_size": 1, "disaggregation_mode": "null"}
    ok = lambda request: web.Response(text="")  # noqa: E731
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, ok)
    for path in ("/get_server_info", "/server_info", "/get_model_info", "/model_info"):
        app.router.add_get(path, lambda request: web.json_response(info))
    app.router.add_get("/get_load", lambda request: web.json_response({"load": 0}))
    app.router.add_get("/v1/models", lambda request: web.json_response(
        {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "fake"}]}))
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16, help="tokens per answer when max_new_tokens is unset")
    p.add_argument("--served-model-name", default="fake")
    p.add_argument("--log-level", default="warning")  # accepted for symmetry with benchmarks.fake_worker
    args = p.parse_args(argv)
    web.run_app(app_for(args.tokens, args.served_model_name), host=args.host, port=args.port, print=None,
                access_log=None)


if __name__ == "__main__":
    main()
