"""A worker's trace spans for one finished sample, built after the fact from the timings the engine reports
(engine.results.RequestTiming: time.monotonic() readings), so the engine itself knows nothing of tracing. They are
children of the current span, the Generate call's server span:

    queue     arrival to first admission by the prefill planner (when the engine reports it)
    prefill   admission to the first output token (colocated workers; a prefill worker: to the KV hand-over)
    decode    first token to the finish, one span with `first_token` and `finished` events (never one per token)

A decode worker of a PD pair has no prefill span: its KV comes from the prefill worker (the `kv_handoff` and
`kv_transfer` spans of services.worker.receive)."""

from __future__ import annotations

from radixmesh.engine.results import RequestTiming
from radixmesh.services.common import tracing


def trace_sample(mode: str, index: int, meta: dict, timing: RequestTiming) -> None:
    """`mode`: the worker's --disaggregation-mode (null, prefill, decode); `meta`: the sample's meta_info. The
    spans share one clock offset, so that each ends exactly where the next begins."""
    offset = tracing.wall_offset_ns()
    admitted = timing.submitted
    if timing.queue_time_s is not None:
        admitted = timing.submitted + timing.queue_time_s
        tracing.record_span("queue", timing.submitted, admitted, index=index, offset_ns=offset)
    first = timing.first_token if timing.first_token is not None else timing.finished
    if mode != "decode":
        tracing.record_span("prefill", admitted, first if mode == "null" else timing.finished, index=index,
                            offset_ns=offset,
                            prompt_tokens=meta.get("prompt_tokens"), cached_tokens=meta.get("cached_tokens"))
    if mode == "prefill" or timing.first_token is None:
        return
    reason = meta.get("finish_reason") or {}
    completion = meta.get("completion_tokens")
    events = (("first_token", timing.first_token, {}),
              ("finished", timing.finished, {"finish_reason": reason.get("type"), "completion_tokens": completion}))
    tracing.record_span("decode", timing.first_token, timing.finished, events, index=index, offset_ns=offset,
                        completion_tokens=completion, finish_reason=reason.get("type"))
