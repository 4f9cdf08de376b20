"""Worker-side counters for GetLoads: prefix-cache hit rate since start and output throughput over a window."""

from __future__ import annotations

import collections
import time

THROUGHPUT_WINDOW_S = 10.0


class WorkerStats:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._outputs: collections.deque[tuple[float, int]] = collections.deque()

    def request_done(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def tokens_out(self, n: int) -> None:
        if n:
            self._outputs.append((time.monotonic(), n))

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def gen_throughput(self) -> float:
        """Output tokens per second over the last THROUGHPUT_WINDOW_S."""
        cutoff = time.monotonic() - THROUGHPUT_WINDOW_S
        while self._outputs and self._outputs[0][0] < cutoff:
            self._outputs.popleft()
        return sum(n for _, n in self._outputs) / THROUGHPUT_WINDOW_S
