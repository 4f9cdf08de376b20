"""The kv_index policy's cost model: a worker's expected time to first token for a prompt, in seconds.

    cost(w) = uncached / prefill_rate(w)                       compute the tokens no tier holds
            + host / host_rate(w) + storage / storage_rate(w)  load the ones its host pool (L2) and the store (L3) hold
            + queue_time(w)                                    the wait before its prefill starts
            + routed(w) / prefill_rate(w)                      what this router sent it since that was measured

    uncached = prompt_len - device - host - storage; device tokens are free (already in the KV pool).
    queue_time(w) = the worker's measured wait from arrival to prefill (GetLoads queue_time_s). A measured wait,
    not queued tokens over the prefill rate: queued work is prefilled in batches together with the new request,
    so counting its tokens one by one overstates it and drives requests away from their cached prefixes.
    routed(w) = the uncached tokens this router has sent the worker since its last load poll (so a burst between
    two polls spreads out instead of landing on one worker).

Rates are the workers' own measurements (GetLoads, tokens per second). Priors where a worker has not measured one
yet (it reports 0):
  - prefill: the median of the measured prefill rates of the candidate workers (same model, similar hardware),
    and PRIOR_PREFILL_TOKENS_PER_S when none has measured it;
  - host loads: HOST_PRIOR_SPEEDUP x the prefill rate (a host-to-device copy of a page is ~20x cheaper than
    recomputing it);
  - store fetches: none. A worker reports a store rate only once it has measured one and only when its prefetch
    policy makes requests wait for their pages (best_effort does not: its L3 pages usually land after the prefill
    started), so an unreported rate means store hits are not worth counting: they cost as much as recomputing.
The host prior only needs the right order: device < host < recompute."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from radixmesh.v1 import worker_pb2

PRIOR_PREFILL_TOKENS_PER_S = 10_000.0
HOST_PRIOR_SPEEDUP = 20.0


@dataclass(frozen=True, slots=True)
class WorkerSpeeds:
    """One worker's last GetLoads answer, as the cost model uses it (0: not measured yet)."""

    prefill_tokens_per_s: float = 0.0
    host_load_tokens_per_s: float = 0.0
    storage_load_tokens_per_s: float = 0.0
    queued_prefill_tokens: int = 0
    queue_time_s: float = 0.0

    @classmethod
    def from_loads(cls, loads: worker_pb2.GetLoadsResponse) -> "WorkerSpeeds":
        return cls(max(loads.prefill_tokens_per_s, 0.0), max(loads.host_load_tokens_per_s, 0.0),
                   max(loads.storage_load_tokens_per_s, 0.0), max(loads.queued_prefill_tokens, 0),
                   max(loads.queue_time_s, 0.0))


UNMEASURED = WorkerSpeeds()


class Rates(NamedTuple):
    """Tokens per second, all > 0."""

    prefill: float
    host: float
    storage: float


class Match(NamedTuple):
    """How many leading prompt tokens each tier holds for a worker: device, then host, then the store after them."""

    device: int = 0
    host: int = 0
    storage: int = 0

    def clipped(self, prompt_len: int) -> "Match":
        """The same match with each tier clipped so the tiers together cover at most the prompt."""
        device = min(max(self.device, 0), prompt_len)
        host = min(max(self.host, 0), prompt_len - device)
        return Match(device, host, min(max(self.storage, 0), prompt_len - device - host))


def fleet_prefill_rate(speeds: Iterable[WorkerSpeeds]) -> float:
    """The prefill prior for workers that have not measured theirs: the median of those that have."""
    measured = [s.prefill_tokens_per_s for s in speeds if s.prefill_tokens_per_s > 0]
    return statistics.median(measured) if measured else PRIOR_PREFILL_TOKENS_PER_S


def rates_of(speeds: WorkerSpeeds, fleet_prefill: float) -> Rates:
    prefill = speeds.prefill_tokens_per_s or fleet_prefill
    return Rates(prefill, speeds.host_load_tokens_per_s or HOST_PRIOR_SPEEDUP * prefill,
                 speeds.storage_load_tokens_per_s or prefill)


def uncached_tokens(prompt_len: int, match: Match) -> int:
    m = match.clipped(prompt_len)
    return prompt_len - m.device - m.host - m.storage


def expected_ttft_s(prompt_len: int, match: Match, rates: Rates, routed_tokens: int,
                    queue_time_s: float = 0.0) -> float:
    """Seconds until the first token on a worker with these rates and `match`, after its measured queue time and
    the prefill of `routed_tokens` sent there since."""
    m = match.clipped(prompt_len)
    uncached = prompt_len - m.device - m.host - m.storage
    return ((uncached + max(routed_tokens, 0)) / rates.prefill + m.host / rates.host
            + m.storage / rates.storage + max(queue_time_s, 0.0))
