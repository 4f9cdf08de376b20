"""A launched step whose results are still on their way to the host (overlap scheduling).

With overlap on, the scheduler launches step N+1 before it reads step N's tokens: step N's results are copied to
pinned host memory behind an event right after sampling, and read (`wait`) once step N+1 is queued on the GPU, so
the CPU's bookkeeping for step N runs while the GPU computes step N+1. A request whose token is still in flight
has `pending == 1`; step N+1 takes that token as its input straight from step N's device tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixmesh.engine.request import Req
from radixmesh.engine.sampling.sampler import SampleResult


def _map_tensors(obj: Any, fn) -> Any:
    """Apply fn to every tensor inside nested tuples / NamedTuples (None stays None)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        values = [_map_tensors(x, fn) for x in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else tuple(values)
    return obj


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


class HostCopy:
    """Device results on their way to pinned host memory; `wait` blocks until they are there."""

    def __init__(self, result: SampleResult, device: torch.device):
        if device.type != "cuda":
            self.result, self.event = result, None
            return
        self.result = _map_tensors(result, _pinned_copy)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> SampleResult:
        if self.event is not None:
            self.event.synchronize()
        return self.result


@dataclass(slots=True)
class InFlight:
    """One launched forward: its requests and, once sampled, the device results and their host copy."""

    reqs: list[Req]
    samples: list[bool]  # per request: this forward ends its fill, so it samples a token
    prefilling: list[bool]  # per request: it was not decoding before this forward
    extend: bool
    plan: Any  # the batch's PromptLogprobPlan, or None
    logits: torch.Tensor | None  # [batch + extra, vocab] float32 until sampled
    result: SampleResult | None = None  # device tensors
    host: HostCopy | None = None
    rows: dict[int, int] = field(default_factory=dict)  # id(req) -> its row in result.next_ids
    launched: float = 0.0  # time.perf_counter() at launch
    new_tokens: int = 0  # tokens this forward computes (prefill rate measurement)
