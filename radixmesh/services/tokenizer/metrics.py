"""The tokenizer service's Prometheus metrics (labels model_name, role="tokenizer", method):

    radixmesh:tokenizer_requests_total{method}          calls (method: tokenize_text, tokenize_chat, detokenize)
    radixmesh:tokenizer_errors_total{method}            calls refused or failed (INVALID_ARGUMENT and others)
    radixmesh:tokenizer_latency_seconds{method}         call time, including the wait for a tokenizer thread
    radixmesh:tokenizer_tokens_total{method}            tokens produced (tokenize) or read (detokenize)"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from radixmesh.services.common.metrics import FAST_BUCKETS, ServiceMetrics

METHODS = ("tokenize_text", "tokenize_chat", "detokenize")  # tokenize_none: a request without input, an error


class TokenizerMetrics:
    def __init__(self, metrics: ServiceMetrics):
        m = metrics
        self.requests = m.counter("radixmesh:tokenizer_requests_total", "Tokenizer calls by method", ("method",))
        self.errors = m.counter("radixmesh:tokenizer_errors_total", "Tokenizer calls that failed", ("method",))
        self.latency = m.histogram("radixmesh:tokenizer_latency_seconds", "Tokenizer call latency (s)",
                                   FAST_BUCKETS, ("method",))
        self.tokens = m.counter("radixmesh:tokenizer_tokens_total",
                                "Tokens produced (tokenize) or read (detokenize)", ("method",))
        for method in METHODS:  # error series from the start, at 0: rate() and increase() then see the first error
            self.errors.labels(method)

    @contextlib.contextmanager
    def call(self, method: str) -> Iterator[None]:
        """Count and time one call; an exception out of it counts as an error."""
        started = time.monotonic()
        try:
            yield
        except Exception:
            self.errors.labels(method).inc()
            raise
        finally:
            self.requests.labels(method).inc()
            self.latency.labels(method).observe(time.monotonic() - started)

    def counted(self, method: str, tokens: int) -> None:
        self.tokens.labels(method).inc(tokens)
