"""The conversations `python -m radixmesh.benchmarks.multiturn` plays and the record each turn leaves.

Every client owns one conversation: an optional system prompt shared by all clients, then `num_rounds` user turns
of random token ids drawn from a seed. Turn r sends the client's whole history (system + user turns 1..r + the
model's answers to turns 1..r-1, as token ids) and waits for its answer before the next turn. Turns take a slot of
`max_parallel` (requests in flight at once, handed out first come first served, so clients interleave as in SGLang's
HiCache benchmark) after being released as a Poisson process of `request_rate` per second (inf: at once)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from radixmesh.benchmarks.serving import arrivals, workload_digest
from radixmesh.benchmarks.serving_backends import GenerateApi, HttpBackend, RequestOutput, StreamTimer, WorkItem


@dataclass(frozen=True, slots=True)
class Workload:
    system: list[int]  # shared prefix of every conversation ([] when none)
    turns: list[list[list[int]]]  # [client][round] -> the new user token ids of that turn
    output_len: int  # generated tokens per turn (ignore_eos)

    @property
    def num_rounds(self) -> int:
        return len(self.turns[0]) if self.turns else 0

    def digest(self) -> str:
        """Identifies the drawn tokens and lengths (the answers depend on the model, so they are not in it)."""
        items = [WorkItem(self.system, 0)] + [WorkItem(t, self.output_len) for client in self.turns for t in client]
        return workload_digest(items)

    def final_prompt_len(self) -> int:
        """Prompt tokens of every client's last turn."""
        return len(self.system) + self.num_rounds * len(self.turns[0][0]) + (self.num_rounds - 1) * self.output_len


def make_workload(num_clients: int, num_rounds: int, request_len: int, output_len: int, system_len: int, seed: int,
                  pool: np.ndarray) -> Workload:
    """Token ids drawn uniformly (with replacement) from `pool`: the system prompt first, then every user turn."""
    rng = np.random.default_rng(seed)
    system = rng.choice(pool, size=system_len)
    turns = rng.choice(pool, size=(num_clients, num_rounds, request_len))
    return Workload(system.tolist(), turns.tolist(), output_len)


@dataclass(slots=True)
class Turn:
    """One answered (or failed) turn; token counts are the server's meta_info (0 when it sent none)."""

    client: int
    round: int  # 1-based
    out: RequestOutput
    prompt_tokens: int = 0
    cached_tokens: int = 0


class TurnApi(GenerateApi):
    """GenerateApi that also keeps each request's last event: /generate events are cumulative, so the last one holds
    every output id and the final meta_info (prompt_tokens, cached_tokens). Kept per WorkItem object until taken."""

    def __init__(self) -> None:
        self._last: dict[int, bytes] = {}  # id(WorkItem) -> raw data of its latest event

    def on_event(self, data: bytes, now: float, timer: StreamTimer) -> str | None:
        if data != b"[DONE]":
            self._last[id(timer.item)] = data
        return super().on_event(data, now, timer)

    def take_final(self, item: WorkItem) -> dict:
        """The parsed last event of `item`'s request ({} when none arrived or it was not JSON); forgets it."""
        raw = self._last.pop(id(item), None)
        try:
            event = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        return event if isinstance(event, dict) else {}


@dataclass(slots=True)
class Pacer:
    """Releases turns at the times `arrivals` yields, then hands each a slot of `max_parallel` (None: unbounded)."""

    ticks: AsyncGenerator[int, None]  # arrivals(); one coroutine at a time may await it (hence the lock)
    lock: asyncio.Lock
    slots: asyncio.Semaphore | contextlib.nullcontext

    @classmethod
    def of(cls, total: int, rate: float, seed: int, max_parallel: int | None) -> Pacer:
        slots = asyncio.Semaphore(max_parallel) if max_parallel else contextlib.nullcontext()
        return cls(arrivals(total, rate, seed), asyncio.Lock(), slots)

    async def release(self) -> None:
        async with self.lock:
            await anext(self.ticks)


def _answer(turn: Turn, event: dict) -> list[int]:
    """Fills the turn's token counts from the last event; returns its output ids (fails the turn without them)."""
    meta = event.get("meta_info") or {}
    turn.prompt_tokens, turn.cached_tokens = int(meta.get("prompt_tokens", 0)), int(meta.get("cached_tokens", 0))
    ids = event.get("output_ids")
    if turn.out.success and (not isinstance(ids, list) or len(ids) != turn.out.output_len):
        turn.out.success, turn.out.error = False, "the last event did not carry every output id"
    return ids if turn.out.success else []


async def play(backend: HttpBackend, api: TurnApi, workload: Workload, client: int, pacer: Pacer, turns: list[Turn],
               bar: tqdm) -> int:
    """Plays one client's conversation, appending a Turn per answer to `turns`; a failed turn ends the conversation.
    Returns the client's history length in tokens at the end (the prompt plus answer of its last turn)."""
    history = list(workload.system)
    for r, user in enumerate(workload.turns[client], start=1):
        item = WorkItem(history + user, workload.output_len)
        await pacer.release()
        async with pacer.slots:
            out = await backend.send(item)
        turn = Turn(client, r, out)
        answer = _answer(turn, api.take_final(item))
        turns.append(turn)
        bar.update(1)
        if not out.success:
            return len(item.input_ids)
        history = item.input_ids + answer
    return len(history)


async def run_clients(backend: HttpBackend, api: TurnApi, workload: Workload, max_parallel: int | None,
                      rate: float, seed: int, disable_tqdm: bool) -> tuple[list[Turn], list[int], float]:
    """Every client's conversation at once (bounded by the pacer). Returns (turns in completion order, each client's
    final history length, duration in s from the first release to the last answer)."""
    n = len(workload.turns)
    pacer = Pacer.of(n * workload.num_rounds, rate, seed, max_parallel)
    turns: list[Turn] = []
    bar = tqdm(total=n * workload.num_rounds, disable=disable_tqdm)
    start = time.perf_counter()
    try:
        histories = await asyncio.gather(*(play(backend, api, workload, c, pacer, turns, bar) for c in range(n)))
    finally:
        await pacer.ticks.aclose()
        bar.close()
    return turns, list(histories), time.perf_counter() - start


def hit_rate(turns: list[Turn]) -> float | None:
    """sum(cached_tokens) / sum(prompt_tokens) over the successful turns (None without any prompt token)."""
    ok = [t for t in turns if t.out.success]
    prompt = sum(t.prompt_tokens for t in ok)
    return sum(t.cached_tokens for t in ok) / prompt if prompt else None


def round_stats(turns: list[Turn], num_rounds: int) -> list[dict]:
    """Per round (1-based): successful turns, mean prompt length, cache hit rate and TTFT (ms) over them."""
    rows = []
    for r in range(1, num_rounds + 1):
        ok = [t for t in turns if t.round == r and t.out.success]
        ttft = np.asarray([t.out.ttft_s for t in ok]) * 1e3
        rows.append({"round": r, "completed": len(ok), "failed": sum(t.round == r and not t.out.success for t in turns),
                     "mean_prompt_len": float(np.mean([t.out.prompt_len for t in ok])) if ok else None,
                     "cache_hit_rate": hit_rate(ok), "mean_ttft_ms": float(ttft.mean()) if ok else None,
                     "p90_ttft_ms": float(np.percentile(ttft, 90)) if ok else None})
    return rows
