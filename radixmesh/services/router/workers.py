"""The router's worker registry: one gRPC channel per worker, model info fetched on add, a background health
probe (grpc.health.v1) every few seconds (and any other per-worker poll a policy adds with `every`), in-flight
counts the policies read, and a circuit breaker per worker (services.router.resilience). A worker that refuses a
call is marked unhealthy at once, so new requests stop going there before the next probe; otherwise
--health-failure-threshold failed probes in a row mark it unhealthy (and give up its open calls: a hung process
holds them otherwise until the request deadline), and --health-success-threshold passed ones healthy again."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from radixmesh.v1 import worker_pb2, worker_pb2_grpc
from radixmesh.services.common.server import channel
from radixmesh.services.router.lora_state import LoraState, poll as poll_lora
from radixmesh.services.router.mux import WorkerMux
from radixmesh.services.router.resilience import CircuitBreaker

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Worker:
    url: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerServiceStub
    info: worker_pb2.GetModelInfoResponse
    healthy: bool = True
    in_flight: int = 0
    failures: int = field(default=0)  # failed probes in a row
    passes: int = field(default=0)  # passed probes in a row
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    mux: WorkerMux | None = None  # the worker's GenerateStream (services/router/mux.py)
    lora: LoraState = field(default_factory=LoraState)  # its LoRA adapters, as it reported them


class NoHealthyWorker(Exception):
    pass



_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9-]{1,63})*|\[[0-9A-Fa-f:.]+\])$")


def normalize_url(url: str) -> str:
    """`host:port` (a grpc:// or http:// prefix and a trailing slash are dropped); ValueError for anything else: a
    host that is not a DNS name, an IPv4 address or a bracketed IPv6 one, or a port outside 1-65535."""
    url = url.strip().removeprefix("grpc://").removeprefix("http://").rstrip("/")
    host, sep, port = url.rpartition(":")
    if not sep or not _HOST.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker url must be host:port, got {url!r}")
    return url


class WorkerRegistry:
    def __init__(self, connect_timeout_s: float, probe_interval_s: float, *, probe_timeout_s: float = 2.0,
                 failure_threshold: int = 3, success_threshold: int = 1, probing: bool = True,
                 new_breaker: Callable[[], CircuitBreaker] = CircuitBreaker, stream_lanes: bool = True):
        """`stream_lanes`: GenerateStream goes over a worker's stream lane where it offers one."""
        self.connect_timeout_s = connect_timeout_s
        self.stream_lanes = stream_lanes
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.new_breaker = new_breaker
        self.workers: dict[str, Worker] = {}  # (a property: setting it, as tests do, forgets _prompts)
        self._loops: list[tuple[float, Callable[[Worker], Awaitable[object]]]] = \
            [(probe_interval_s, self.probe)] if probing else []
        self._jobs: list[tuple[float, Callable[[], Awaitable[object]]]] = [(1.0, self._expire_leases)]
        self._tasks: list[asyncio.Task] = []
        self._leases: dict[str, float] = {}  # url -> monotonic deadline of a worker's self-registration
        self.on_add: Callable[[Worker], None] = lambda worker: None  # called once a worker is registered
        self.on_remove = lambda url: None
        self.on_lost = lambda worker: None  # called once a worker failed failure_threshold probes in a row
        # what this process changed, for its sibling router processes (--router-workers; services/router/peers.py):
        # on_change(op, url, **details) with op add, remove, lease, health or lost; changes applied from a sibling
        # pass quiet=True and are not announced again
        self.on_change: Callable[..., None] = lambda op, url, **details: None

    async def add(self, url: str, quiet: bool = False) -> Worker:
        """Connect and fetch the model info; ValueError if the worker cannot be reached or serves another model."""
        url = normalize_url(url)
        if url in self.workers:
            return self.workers[url]
        worker = await self._connect(url)
        if not quiet:
            self.on_change("add", worker.url)
        return worker

    async def _connect(self, url: str) -> Worker:
        ch = channel(url)
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        try:
            info = await stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=self.connect_timeout_s,
                                           wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            await ch.close()
            raise ValueError(f"worker {url} did not answer GetModelInfo: {e.code().name} {e.details()}") from None
        lora = LoraState()
        await poll_lora(stub, lora, self.connect_timeout_s)
        if url in self.workers:  # added by a concurrent call while this one waited
            await ch.close()
            return self.workers[url]
        others = [w.info.served_model_name for w in self.workers.values()]
        if others and info.served_model_name != others[0]:
            await ch.close()
            raise ValueError(f"worker {url} serves {info.served_model_name!r}, the others {others[0]!r}")
        # GenerateStream carries colocated calls; a PD pair's calls are plain Generate calls (services/router/pd.py)
        mux = WorkerMux(stub, url, self.connect_timeout_s, ch if self.stream_lanes else None) \
            if info.disaggregation_mode == "null" else None
        worker = Worker(url, ch, stub, info, breaker=self.new_breaker(), mux=mux, lora=lora)
        self._workers[url] = worker
        self._prompts = None
        log.info("added worker %s (%s, %s)", url, info.served_model_name, info.disaggregation_mode)
        self.on_add(worker)
        return worker

    def lease(self, url: str, lease_s: float | None, quiet: bool = False) -> None:
        """A registration that lapses: `url` is removed unless leased again within `lease_s` seconds (workers that
        register themselves renew it; one that dies without leaving is forgotten). None: registered for good."""
        url = normalize_url(url)
        if not quiet:
            self.on_change("lease", url, lease_s=lease_s)
        if lease_s is None:
            self._leases.pop(url, None)
        else:
            self._leases[url] = time.monotonic() + lease_s

    async def _expire_leases(self) -> None:
        now = time.monotonic()
        for url in [u for u, deadline in self._leases.items() if deadline < now]:
            log.warning("worker %s did not renew its registration; removing it", url)
            await self.remove(url, quiet=True)  # every router process keeps the same leases

    async def remove(self, url: str, quiet: bool = False) -> bool:
        url = normalize_url(url)
        self._leases.pop(url, None)
        worker = self._workers.pop(url, None)
        if worker is None:
            return False
        self._prompts = None
        if not quiet:
            self.on_change("remove", worker.url)
        self.on_remove(worker.url)
        if worker.mux is not None:
            await worker.mux.close()
        await worker.channel.close(grace=None)
        log.info("removed worker %s", worker.url)
        return True

    def healthy(self, mode: str = "null") -> list[Worker]:
        """Healthy workers of one disaggregation mode (null: colocated, prefill or decode) whose circuit breaker
        lets a request through now."""
        return [w for w in self.workers.values()
                if w.healthy and w.info.disaggregation_mode == mode and w.breaker.available()]

    @property
    def disaggregated(self) -> bool:
        """True when prefill/decode workers are registered (requests then go to a pair)."""
        return any(w.info.disaggregation_mode != "null" for w in self.workers.values())

    @property
    def workers(self) -> dict[str, Worker]:
        return self._workers

    @workers.setter
    def workers(self, workers: dict[str, Worker]) -> None:
        self._workers = workers
        self._prompts = None

    def _prompt_kinds(self) -> tuple[bool, str, bool]:
        """(tokenize_text, the chat template's SHA-256 every worker renders with or "", whether every worker reports
        where its rendering leaves the thinking), kept until a worker is added or removed (asked on every
        request)."""
        if self._prompts is None:
            workers = self._workers.values()
            text = bool(workers) and all(w.info.tokenizes_text and w.info.disaggregation_mode == "null"
                                         for w in workers)
            shas = {w.info.chat_template_sha256 for w in workers}
            thinking = text and all(w.info.reports_prompt_thinking for w in workers)
            self._prompts = (text, shas.pop() if text and len(shas) == 1 else "", thinking)
        return self._prompts

    @property
    def tokenize_text(self) -> bool:
        """True when every registered worker is colocated and tokenizes text-only requests itself (its model info
        says `tokenizes_text`): text prompts may then go to any of them untokenized."""
        return self._prompt_kinds()[0]

    def renders_chat(self, template_sha256: str, thinking: bool = False) -> bool:
        """True when text prompts go to the workers (tokenize_text) and every one renders chat prompts with the
        chat template whose SHA-256 is `template_sha256` (the tokenizer service's): chat prompts may then go to
        any of them as messages. `thinking`: and every one says where its rendering leaves the thinking
        (GetModelInfo's reports_prompt_thinking), as a --reasoning-parser needs."""
        kinds = self._prompt_kinds()
        return bool(template_sha256) and kinds[1] == template_sha256 and (kinds[2] or not thinking)

    def any_info(self) -> worker_pb2.GetModelInfoResponse | None:
        for w in self.workers.values():
            return w.info
        return None

    def mark_failed(self, worker: Worker, reason: str, quiet: bool = False) -> None:
        if worker.healthy:
            log.warning("worker %s marked unhealthy: %s", worker.url, reason)
            if not quiet:
                self.on_change("health", worker.url, healthy=False, reason=reason)
        worker.healthy = False
        worker.passes = 0

    def mark_healthy(self, worker: Worker, reason: str, quiet: bool = False) -> None:
        if not worker.healthy:
            log.info("worker %s is healthy again (%s)", worker.url, reason)
            if not quiet:
                self.on_change("health", worker.url, healthy=True, reason=reason)
        worker.healthy = True

    async def probe(self, worker: Worker) -> bool:
        stub = health_pb2_grpc.HealthStub(worker.channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.probe_timeout_s)
            ok, reason = resp.status == health_pb2.HealthCheckResponse.SERVING, "not serving"
        except grpc.aio.AioRpcError as e:
            ok, reason = False, e.code().name
        worker.failures = 0 if ok else worker.failures + 1
        worker.passes = worker.passes + 1 if ok else 0
        if ok and not worker.healthy and worker.passes >= self.success_threshold:
            self.mark_healthy(worker, f"{worker.passes} health probes passed")
        elif not ok and worker.failures >= self.failure_threshold:
            self.mark_failed(worker, f"{worker.failures} health probes failed ({reason})")
        if worker.failures == self.failure_threshold:
            log.warning("worker %s failed %d probes in a row; failing its open requests", worker.url,
                        worker.failures)
            self.on_lost(worker)
            self.on_change("lost", worker.url)
        return ok

    def every(self, interval_s: float, fn: Callable[[Worker], Awaitable[object]]) -> None:
        """Call `fn(worker)` for every registered worker (concurrently; errors ignored) each `interval_s` seconds,
        like the health probe, from start() (or now, when started already) until close()."""
        self._loops.append((interval_s, fn))
        if self._tasks:
            self._tasks.append(asyncio.create_task(self._loop(interval_s, fn)))

    def schedule(self, interval_s: float, job: Callable[[], Awaitable[object]]) -> None:
        """Run `job()` every `interval_s` seconds from start() (or now, when started already) until close(); an
        error is logged and the job goes on."""
        self._jobs.append((interval_s, job))
        if self._tasks:
            self._tasks.append(asyncio.create_task(self._job(interval_s, job)))

    async def _loop(self, interval_s: float, fn: Callable[[Worker], Awaitable[object]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.gather(*(fn(w) for w in list(self.workers.values())), return_exceptions=True)

    @staticmethod
    async def _job(interval_s: float, job: Callable[[], Awaitable[object]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await job()
            except Exception:  # noqa: BLE001 - a background job must outlive one bad round
                log.exception("background job %s failed; it runs again in %.1f s", job, interval_s)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._loop(interval, fn)) for interval, fn in self._loops]
        self._tasks += [asyncio.create_task(self._job(interval, job)) for interval, job in self._jobs]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for w in list(self.workers.values()):
            if w.mux is not None:
                await w.mux.close()
            await w.channel.close(grace=None)
