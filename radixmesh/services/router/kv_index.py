"""Policy `kv_index`: route each request to the worker with the lowest expected time to first token, from the
kvstore's global prefix index (which tokens of the prompt each worker holds, per tier: MatchPrefix) and the
workers' measured speeds and queues (GetLoads, polled every LOAD_POLL_INTERVAL_S). The cost model is ttft_cost.py.

- Ties (costs within TIE_ABS_S + TIE_REL x the best) go to the tied worker that rendezvous hashing of the prompt's
  first tokens picks, so router replicas with the same index and idle workers agree without talking.
- A worker the index does not list counts as holding nothing.
- The index is asked with the request's tenant (pages are only reused within a namespace) and bounded by
  --kvstore-timeout-s. When the call fails or times out the request goes to the least loaded worker (in-flight
  requests; ties by rendezvous hashing), the reason is logged (at most every LOG_EVERY_S) and counted, and the index
  is skipped for INDEX_BACKOFF_S, so a hung kvstore costs the timeout once per backoff, not on every request.
- Every choice is counted per worker and reason in `decisions` (decisions.py)."""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import grpc

from radixmesh.v1 import kvstore_pb2, kvstore_pb2_grpc, worker_pb2
from radixmesh.services.common import tracing
from radixmesh.services.common.server import untraced_channel
from radixmesh.services.router.decisions import RoutingDecisions
from radixmesh.services.router.policies import Candidate
from radixmesh.services.router.rendezvous import prompt_key, rendezvous
from radixmesh.services.router.ttft_cost import (UNMEASURED, Match, WorkerSpeeds, expected_ttft_s, fleet_prefill_rate,
                                                 rates_of, uncached_tokens)

log = logging.getLogger(__name__)

LOAD_POLL_INTERVAL_S = 0.5
LOAD_POLL_TIMEOUT_S = 1.0
TIE_ABS_S = 1e-3
TIE_REL = 0.02
INDEX_BACKOFF_S = 0.5
LOG_EVERY_S = 10.0


def _url(url: str) -> str:
    return url.strip().removeprefix("grpc://").removeprefix("http://").rstrip("/")


class KvIndexPolicy:
    """Not thread-safe: used from the router's event loop only."""

    def __init__(self, kvstore_url: str, timeout_s: float, registry=None,
                 clock: Callable[[], float] = time.monotonic):
        """`registry` (WorkerRegistry), when given: every worker's GetLoads is polled on its loop each
        LOAD_POLL_INTERVAL_S."""
        self.kvstore_url = kvstore_url
        self.timeout_s = timeout_s
        self._channel = untraced_channel(kvstore_url)  # MatchPrefix passes its trace context itself
        self._stub = kvstore_pb2_grpc.KvStoreServiceStub(self._channel)
        self._channel.get_state(try_to_connect=True)  # connect now, not within the first request's timeout
        self._clock = clock
        self.speeds: dict[str, WorkerSpeeds] = {}  # url -> its last GetLoads answer
        self.routed: dict[str, int] = {}  # url -> uncached tokens sent there since its last load poll
        self.decisions = RoutingDecisions()
        self.fallbacks = 0
        self._skip_index_until = float("-inf")
        # the last pick, for its trace span: prompt tokens the chosen worker holds (any tier), and why it was chosen
        self.last_matched_tokens = 0
        self.last_reason = ""
        self._last_log = float("-inf")
        self._unlogged = 0
        if registry is not None:
            registry.every(LOAD_POLL_INTERVAL_S, self.poll)

    async def pick_async(self, workers: Sequence[Candidate], input_ids: Sequence[int], tenant: str = "") -> Candidate:
        """Choose among `workers` (non-empty) for a prompt of `tenant`; records the choice."""
        matches = await self._match(input_ids, tenant)
        if matches is None:
            return self._fallback(workers, input_ids)
        return self._cheapest(workers, input_ids, matches)

    def pick(self, workers: Sequence[Candidate], input_ids: Sequence[int], namespace: str = "") -> Candidate:
        """The synchronous interface can not ask the index: least loaded, ties by rendezvous (a "fallback")."""
        return self._fallback(workers, input_ids)

    def costs(self, workers: Sequence[Candidate], input_ids: Sequence[int],
              matches: dict[str, kvstore_pb2.WorkerMatch]) -> list[float]:
        """Each worker's expected time to first token, in seconds (no side effects)."""
        n = len(input_ids)
        fleet = fleet_prefill_rate(self.speeds.get(w.url, UNMEASURED) for w in workers)
        out = []
        for w in workers:
            speeds = self.speeds.get(w.url, UNMEASURED)
            out.append(expected_ttft_s(n, _match_of(matches.get(w.url)), rates_of(speeds, fleet),
                                       self.routed.get(w.url, 0), speeds.queue_time_s))
        return out

    def _cheapest(self, workers, input_ids, matches) -> Candidate:
        costs = self.costs(workers, input_ids, matches)
        best = min(costs)
        tied = [w for w, c in zip(workers, costs) if c <= best + TIE_ABS_S + TIE_REL * best]
        if len(tied) == 1:
            chosen, reason = tied[0], "index"
        else:
            chosen, reason = rendezvous(tied, prompt_key(input_ids)), "tie"
        self._routed(chosen, uncached_tokens(len(input_ids), _match_of(matches.get(chosen.url))), reason,
                     len(input_ids))
        return chosen

    def _fallback(self, workers, input_ids) -> Candidate:
        self.fallbacks += 1
        least = min(w.in_flight for w in workers)
        chosen = rendezvous([w for w in workers if w.in_flight == least], prompt_key(input_ids))
        self._routed(chosen, len(input_ids), "fallback", len(input_ids))
        return chosen

    def _routed(self, worker: Candidate, uncached: int, reason: str, prompt_tokens: int = 0) -> None:
        self.last_matched_tokens, self.last_reason = max(prompt_tokens - uncached, 0), reason
        self.routed[worker.url] = self.routed.get(worker.url, 0) + uncached
        self.decisions.record(worker.url, reason)

    async def _match(self, input_ids, tenant: str) -> dict[str, kvstore_pb2.WorkerMatch] | None:
        """url -> its match from the index; None when the index can not be asked now."""
        if self._clock() < self._skip_index_until:
            self._unlogged += 1
            return None
        request = kvstore_pb2.MatchPrefixRequest(token_ids=input_ids, tenant=tenant)
        with tracing.span("kvstore MatchPrefix", "client", kvstore=self.kvstore_url,
                          prompt_tokens=len(input_ids)) as span:
            try:
                response = await self._stub.MatchPrefix(request, timeout=self.timeout_s,
                                                         metadata=tracing.current_metadata())
            except grpc.aio.AioRpcError as e:
                self._index_failed(f"{e.code().name}: {e.details()}")
                if span is not None:
                    span.set_attribute("radixmesh.error", e.code().name)
                return None
            if span is not None:
                span.set_attribute("radixmesh.workers_matched", len(response.matches))
        return {_url(m.worker_url): m for m in response.matches}

    def _index_failed(self, reason: str) -> None:
        now = self._clock()
        self._skip_index_until = now + INDEX_BACKOFF_S
        self._unlogged += 1
        if now - self._last_log >= LOG_EVERY_S:
            log.warning("kvstore %s MatchPrefix failed (%s); routing by load alone for %.1f s (%d requests routed "
                        "without the index since the last report)", self.kvstore_url, reason, INDEX_BACKOFF_S,
                        self._unlogged)
            self._last_log, self._unlogged = now, 0

    async def poll(self, worker) -> None:
        """Fetch one worker's loads (GetLoads); a failed poll keeps the last answer."""
        if not worker.healthy:
            return
        routed_before = self.routed.get(worker.url, 0)
        try:
            loads = await worker.stub.GetLoads(worker_pb2.GetLoadsRequest(), timeout=LOAD_POLL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.debug("GetLoads on %s failed: %s", worker.url, e.code().name)
            return
        self.observe_loads(worker.url, loads, routed_before)

    def observe_loads(self, url: str, loads: worker_pb2.GetLoadsResponse, routed_before: int | None = None) -> None:
        """Take a worker's GetLoads answer. The tokens routed there before the poll was sent (`routed_before`;
        None: all of them) are now in its queue (and its measured queue time), or prefilled, so they stop counting
        separately."""
        self.speeds[url] = WorkerSpeeds.from_loads(loads)
        routed = self.routed.get(url, 0)
        self.routed[url] = max(routed - (routed if routed_before is None else routed_before), 0)

    def forget(self, url: str) -> None:
        self.speeds.pop(url, None)
        self.routed.pop(url, None)

    async def close(self) -> None:
        await self._channel.close(grace=None)


def _match_of(m: kvstore_pb2.WorkerMatch | None) -> Match:
    """The tiers of a worker's match; matched_tokens not split into device and host counts as device."""
    if m is None:
        return Match()
    return Match(max(m.device_tokens, m.matched_tokens - m.host_tokens), m.host_tokens, m.storage_tokens)
