"""SGLang's native HTTP endpoints on the router: /generate, /health, /health_generate, /get_model_info,
/get_server_info, /flush_cache, /start_profile, /stop_profile, /add_worker, /remove_worker; and the probes SGLang's
router has for Kubernetes:
/liveness (the process answers) and /readiness (a request could be served now)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import grpc
from aiohttp import web

from radixmesh.v1 import worker_pb2
from radixmesh.services.router import generate_api
from radixmesh.services.router.core import Router, RouterError
from radixmesh.services.router.merge import merged
from radixmesh.services.router.cork import Cork
from radixmesh.services.router.http_common import first_then_sse, json_body, require_model_kind, start_sse, tenant_of
from radixmesh.services.router.allowlist import allowlist
from radixmesh.services.router.openai_errors import OpenAIError, bad_request, from_status
from radixmesh.services.router.openai_response import SSE_DONE, error_event, json_body_response, sse
from radixmesh.services.router.workers import normalize_url

log = logging.getLogger(__name__)
ROUTER = web.AppKey("router", Router)
SECRETS = frozenset({"api_key", "api_key_tenants"})  # settings /get_server_info never shows


async def generate(request: web.Request) -> web.StreamResponse:
    router = request.app[ROUTER]
    require_model_kind(router, generation=True)
    try:
        jobs, is_batch, stream, lp = generate_api.parse(await json_body(request))
    except ValueError as e:
        raise bad_request(str(e)) from None
    if not stream:
        results = await generate_api.run_batch(router, jobs, lp, tenant_of(request))
        return json_body_response(results if is_batch or len(results) > 1 else results[0])
    # Tokenize and build every prompt's request first: bad input is a 400 before the stream starts.
    requests = [await generate_api.worker_request(router, job, lp, stream=True, tenant=tenant_of(request))
                for job in jobs]
    if not is_batch:
        return await _stream_one(request, router, jobs[0], requests[0], lp)
    return await _stream_batch(request, router, jobs, requests, lp)


async def _stream_one(request: web.Request, router: Router, job, worker_request, lp) -> web.StreamResponse:
    """One prompt: events go straight from the worker stream to the client (no queue, no extra task)."""
    events = generate_api.stream_events(router, job, worker_request, lp)
    async with contextlib.aclosing(events):
        with Cork() as out:  # entered first, so that the first message says whether more are queued
            first, resp = await first_then_sse(request, events)
            out.start(resp)
            try:
                await out.write(sse(first))
                async for event in events:
                    await out.write(sse(event))
            except RouterError as e:
                await out.write(sse(error_event(from_status(e.status, e.message))))
            await out.close(SSE_DONE)
    return resp


async def _stream_batch(request: web.Request, router: Router, jobs, worker_requests, lp) -> web.StreamResponse:
    """A batch: every prompt streams at once; events carry `index` (prompt i's samples follow prompt i-1's). When
    one prompt fails, an error event ends the stream and the other prompts are cancelled (as a whole batch is)."""
    resp = await start_sse(request)
    offsets = [sum(j.n for j in jobs[:i]) for i in range(len(jobs))]
    streams = [generate_api.stream_events(router, j, r, lp, o) for j, r, o in zip(jobs, worker_requests, offsets)]
    try:
        async for _, event in merged(streams):
            await resp.write(sse(event))
    except RouterError as e:
        await resp.write(sse(error_event(from_status(e.status, e.message))))
    await resp.write(SSE_DONE)
    return resp


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def readiness(request: web.Request) -> web.Response:
    """200 when a healthy colocated worker, or a healthy prefill and decode worker, is registered; else 503."""
    registry = request.app[ROUTER].registry
    ready = bool(registry.healthy("null")) or bool(registry.healthy("prefill") and registry.healthy("decode"))
    counts = {mode: len(registry.healthy(mode)) for mode in ("null", "prefill", "decode")}
    body = {"ready": ready, "healthy_workers": {"colocated": counts["null"], "prefill": counts["prefill"],
                                                "decode": counts["decode"]}}
    return web.json_response(body, status=200 if ready else 503)


async def health_generate(request: web.Request) -> web.Response:
    """200 when requests can be served now: a colocated worker generates a token, or (PD) a prefill worker's
    scheduler answers and a decode worker generates a token; each worker's answer in the body."""
    router = request.app[ROUTER]
    workers = list(router.registry.workers.values())
    if not workers:
        raise RouterError(503, "no worker that serves requests is registered")

    async def check(w):
        try:
            r = await w.stub.HealthCheck(worker_pb2.HealthCheckRequest(),
                                         timeout=router.settings.connect_timeout_s + 20)
            ok, msg = r.healthy, r.message
        except grpc.aio.AioRpcError as e:
            ok, msg = False, f"{e.code().name}: {e.details()}"
        if not ok:
            router.registry.mark_failed(w, msg)
        else:  # a generated token is stronger evidence than the next probe
            router.registry.mark_healthy(w, "it generated a token")
        mode = w.info.disaggregation_mode
        return {"url": w.url, "healthy": ok, "message": msg, "mode": "colocated" if mode == "null" else mode}

    results = await asyncio.gather(*(check(w) for w in workers))
    up = {r["mode"] for r in results if r["healthy"]}
    status = 200 if "colocated" in up or {"prefill", "decode"} <= up else 503
    return web.json_response({"workers": results}, status=status)


async def get_model_info(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    info = router.registry.any_info()
    if info is None:
        raise RouterError(503, "no worker registered")
    return web.json_response({"model_path": info.model_path, "tokenizer_path": info.tokenizer_path,
                              "is_generation": info.is_generation, "served_model_name": router.model_name,
                              "max_context_length": info.max_context_length, "vocab_size": info.vocab_size,
                              "model_type": info.model_type,
                              "preferred_sampling_params": info.preferred_sampling_params or None})


async def get_server_info(request: web.Request) -> web.Response:
    """The first healthy worker's server info at the top level (SGLang's shape), every worker's under `workers`."""
    router = request.app[ROUTER]

    async def one(w):
        try:
            r = await w.stub.GetServerInfo(worker_pb2.GetServerInfoRequest(), timeout=router.settings.connect_timeout_s)
            return {"url": w.url, **json.loads(r.server_info_json)}
        except grpc.aio.AioRpcError as e:
            return {"url": w.url, "error": f"{e.code().name}: {e.details()}"}

    infos = await asyncio.gather(*(one(w) for w in router.registry.workers.values()))
    top = next((i for i in infos if "error" not in i), {})
    settings = {k: getattr(router.settings, k) for k in router.settings.__dataclass_fields__ if k not in SECRETS}
    body = {**top, "router": settings, "workers": infos}
    decisions = getattr(router.policy, "decisions", None)
    if decisions is not None:
        body["routing_decisions"] = decisions.snapshot()
    return web.json_response(body, dumps=lambda o: json.dumps(o, default=str))


async def flush_cache(request: web.Request) -> web.Response:
    router = request.app[ROUTER]

    async def one(w):
        try:
            r = await w.stub.FlushCache(worker_pb2.FlushCacheRequest(), timeout=router.settings.connect_timeout_s)
            return r.success, r.message
        except grpc.aio.AioRpcError as e:
            return False, f"{w.url}: {e.code().name}"

    results = await asyncio.gather(*(one(w) for w in router.registry.workers.values()))
    failed = [m for ok, m in results if not ok]
    if failed:  # SGLang answers this 400 in plain text; here it is an error object, as every other 4xx
        raise bad_request("Cache not flushed: " + "; ".join(failed))
    return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are running "
                             "or waiting requests, the operation will not be performed.)\n")


PROFILE_FIELDS = ("output_dir", "num_steps", "activities", "with_stack", "record_shapes")


def _profile_request(body) -> worker_pb2.StartProfileRequest:
    """SGLang's /start_profile body (all optional) as the workers' request; ValueError says what is wrong."""
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object (or empty)")
    body = {k: v for k, v in body.items() if v is not None}
    if body.pop("profile_by_stage", False):
        raise ValueError("profile_by_stage is not supported: profiles cover whole steps")
    unknown = sorted(set(body) - set(PROFILE_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}; /start_profile takes {list(PROFILE_FIELDS)}")
    out, steps, acts = body.get("output_dir", ""), body.get("num_steps"), body.get("activities", [])
    if not isinstance(out, str):
        raise ValueError("output_dir must be a string")
    if steps is not None and (type(steps) is not int or not 1 <= steps <= 1 << 31):
        raise ValueError("num_steps must be a positive integer (absent or null: until /stop_profile)")
    if not isinstance(acts, list) or not all(isinstance(a, str) for a in acts):
        raise ValueError('activities must be a list of names ("CPU", "GPU")')
    flags = {k: body.get(k, False) for k in ("with_stack", "record_shapes")}
    if not all(isinstance(v, bool) for v in flags.values()):
        raise ValueError("with_stack and record_shapes must be true or false")
    return worker_pb2.StartProfileRequest(output_dir=out, num_steps=steps or 0, activities=acts, **flags)


async def _on_workers(router: Router, call: str, request) -> list[tuple[str, list[str] | None, str]]:
    """`call` (a profile RPC) on every worker at once: (url, files or None, why it failed) each."""
    async def one(w):
        try:
            r = await getattr(w.stub, call)(request, timeout=router.settings.request_timeout_s)
            return w.url, list(r.files), ""
        except grpc.aio.AioRpcError as e:
            return w.url, None, f"{w.url}: {e.details() or e.code().name}"

    return await asyncio.gather(*(one(w) for w in list(router.registry.workers.values())))


async def start_profile(request: web.Request) -> web.Response:
    """SGLang's /start_profile: every worker profiles its next steps (torch.profiler; body: output_dir, num_steps,
    activities, with_stack, record_shapes, all optional). All or none: when one worker refuses, the others stop."""
    router = request.app[ROUTER]
    try:
        req = _profile_request(await json_body(request) if await request.read() else None)
    except ValueError as e:
        raise bad_request(str(e)) from None
    if not router.registry.workers:
        raise from_status(503, "no worker to profile")
    results = await _on_workers(router, "StartProfile", req)
    failed = [why for _, files, why in results if files is None]
    if failed:
        started = [url for url, files, _ in results if files is not None]
        if started:
            await _stop_started(router, started)
        raise bad_request("Profiling not started: " + "; ".join(failed))
    lines = "".join(f"{url}: {files[0]}\n" for url, files, _ in results)
    return web.Response(text="Start profiling.\n" + lines)


async def _stop_started(router: Router, urls: list[str]) -> None:
    """Stop the profiles a failed /start_profile did start (best effort: each failure is logged)."""
    for url in urls:
        w = router.registry.workers.get(url)
        if w is None:
            continue
        try:
            await w.stub.StopProfile(worker_pb2.StopProfileRequest(), timeout=router.settings.request_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.warning("could not stop the profile started on %s: %s", url, e.details() or e.code().name)


async def stop_profile(request: web.Request) -> web.Response:
    """SGLang's /stop_profile: every worker writes its trace; lists the files, worker by worker."""
    router = request.app[ROUTER]
    if not router.registry.workers:
        raise from_status(503, "no worker to profile")
    results = await _on_workers(router, "StopProfile", worker_pb2.StopProfileRequest())
    failed = [why for _, files, why in results if files is None]
    if failed and len(failed) == len(results):
        raise bad_request("Profiling not stopped: " + "; ".join(failed))
    lines = "".join(f"{url}: {', '.join(files)}\n" for url, files, _ in results if files is not None)
    lines += "".join(f"not stopped: {why}\n" for why in failed)
    return web.Response(text="Stop profiling. This will take some time.\n" + lines)


def _url_param(request: web.Request) -> str:
    url = request.query.get("url")
    if not url:
        raise bad_request("give the worker as ?url=host:port", param="url")
    return url


def _lease_param(request: web.Request) -> float | None:
    raw = request.query.get("lease_s")
    if raw is None:
        return None
    try:
        lease_s = float(raw)
    except ValueError:
        lease_s = float("nan")
    if not 0 < lease_s < 86400:
        raise bad_request(f"lease_s must be seconds in (0, 86400), got {raw!r}", param="lease_s")
    return lease_s


async def add_worker(request: web.Request) -> web.Response:
    """Registers a worker (again: idempotent). With ?lease_s=N the registration lapses unless renewed within N s:
    workers that register themselves (--router-url) renew it, so one that dies without leaving is forgotten."""
    router = request.app[ROUTER]
    lease_s = _lease_param(request)
    url = _url_param(request)
    try:
        host = normalize_url(url).rpartition(":")[0]
    except ValueError as e:
        raise bad_request(f"Failed to add worker: {e}", param="url") from None
    allowed = allowlist(router.settings.worker_allowlist)
    if allowed is not None and not allowed.allows(host):
        log.warning("refused to add worker %s: %s is not in --worker-allowlist", url, host)
        raise OpenAIError(403, f"Failed to add worker: host {host} is not in the router's --worker-allowlist",
                          param="url", code="worker_not_allowed")
    try:
        worker = await router.registry.add(url)
    except ValueError as e:
        raise bad_request(f"Failed to add worker: {e}", param="url") from None
    router.registry.lease(worker.url, lease_s)
    await router.registry.probe(worker)
    return web.Response(text=f"Added worker: {worker.url}\n")


async def remove_worker(request: web.Request) -> web.Response:
    url = _url_param(request)
    if not await request.app[ROUTER].registry.remove(url):
        raise from_status(404, f"no worker {url}")
    return web.Response(text=f"Removed worker: {url}\n")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/liveness", health)
    app.router.add_get("/readiness", readiness)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_post("/flush_cache", flush_cache)
    for path, handler in (("/start_profile", start_profile), ("/stop_profile", stop_profile)):
        app.router.add_get(path, handler)  # SGLang takes both
        app.router.add_post(path, handler)
    app.router.add_post("/add_worker", add_worker)
    app.router.add_post("/remove_worker", remove_worker)
