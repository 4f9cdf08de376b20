"""W3C trace context and sampling for the span recorder (services.common.trace_recorder), read from the standard
variables once at set-up:

- OTEL_TRACES_SAMPLER: always_on, always_off, traceidratio, parentbased_always_on (the default),
  parentbased_always_off, parentbased_traceidratio; OTEL_TRACES_SAMPLER_ARG: the ratio (0..1, default 1). A parent-
  based sampler follows the parent's sampled flag (remote or local) and applies its root sampler to new traces only.
  traceidratio samples when the trace id's low 64 bits are below ratio * 2**64, as the OpenTelemetry SDKs do, so
  every service of a trace decides alike.
- OTEL_PROPAGATORS: `tracecontext` (traceparent, tracestate) and `baggage` (passed on unchanged), both by default;
  `none` turns propagation off. Others (b3, jaeger, ...) are not supported and are ignored with a warning.

Ids are ints here (trace id 128 bits, span id 64 bits); they become hex only on the wire (traceparent) and bytes in
the exporter process."""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

log = logging.getLogger(__name__)

TRACEPARENT, TRACESTATE, BAGGAGE = "traceparent", "tracestate", "baggage"
DEFAULT_SAMPLER = "parentbased_always_on"
_SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
             "parentbased_traceidratio")
LOW64 = (1 << 64) - 1


class RemoteContext(NamedTuple):
    """A caller's span as its traceparent (and tracestate, baggage headers) describes it."""

    trace_id: int
    span_id: int
    sampled: bool
    tracestate: str
    baggage: str


class Sampler:
    """The sampling decision for a new span: `sample(parent_sampled, trace_id)`, parent_sampled None for a root."""

    def __init__(self, name: str = DEFAULT_SAMPLER, ratio: float = 1.0):
        self.name = name
        self.parent_based = name.startswith("parentbased_")
        root = name.removeprefix("parentbased_")
        # ids whose low 64 bits fall below the bound are sampled: 2**64 for always_on, 0 for always_off
        self.bound = {"always_on": 1 << 64, "always_off": 0}.get(root, round(ratio * (1 << 64)))

    def sample(self, parent_sampled: bool | None, trace_id: int) -> bool:
        if parent_sampled is not None and self.parent_based:
            return parent_sampled
        return (trace_id & LOW64) < self.bound

    @classmethod
    def from_env(cls, env: dict | None = None) -> "Sampler":
        env = os.environ if env is None else env
        name = (env.get("OTEL_TRACES_SAMPLER") or DEFAULT_SAMPLER).strip().lower()
        if name not in _SAMPLERS:
            log.warning("OTEL_TRACES_SAMPLER=%s is not supported (%s); using %s", name, ", ".join(_SAMPLERS),
                        DEFAULT_SAMPLER)
            name = DEFAULT_SAMPLER
        ratio = 1.0
        if name.endswith("traceidratio"):
            arg = env.get("OTEL_TRACES_SAMPLER_ARG")
            try:
                ratio = float(arg) if arg is not None else 1.0
                if not 0.0 <= ratio <= 1.0:
                    raise ValueError
            except ValueError:
                log.warning("OTEL_TRACES_SAMPLER_ARG=%s is not a ratio in [0, 1]; using 1.0", arg)
                ratio = 1.0
        return cls(name, ratio)


class Propagation(NamedTuple):
    """Which headers travel with a call (OTEL_PROPAGATORS)."""

    tracecontext: bool = True
    baggage: bool = True

    @classmethod
    def from_env(cls, env: dict | None = None) -> "Propagation":
        env = os.environ if env is None else env
        names = {n.strip().lower() for n in (env.get("OTEL_PROPAGATORS") or "tracecontext,baggage").split(",")}
        unknown = names - {"tracecontext", "baggage", "none", ""}
        if unknown:
            log.warning("OTEL_PROPAGATORS: %s not supported (tracecontext, baggage, none); ignored",
                        ", ".join(sorted(unknown)))
        if "none" in names:
            return cls(False, False)
        return cls("tracecontext" in names, "baggage" in names)


def parse_traceparent(value: str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) from a W3C traceparent header; None when absent or malformed."""
    if not value or len(value) < 55:
        return None
    version, trace_hex, span_hex, flags = value[:2], value[3:35], value[36:52], value[53:55]
    if value[2] != "-" or value[35] != "-" or value[52] != "-" or version == "ff":
        return None
    if (version == "00" and len(value) != 55) or (len(value) > 55 and value[55] != "-"):
        return None
    try:
        if not all(c in "0123456789abcdef" for c in value[:55].replace("-", "")):
            return None
        trace_id, span_id, bits = int(trace_hex, 16), int(span_hex, 16), int(flags, 16)
    except ValueError:
        return None
    if trace_id == 0 or span_id == 0:
        return None
    return trace_id, span_id, bool(bits & 1)


def extract(carrier, propagation: Propagation) -> RemoteContext | None:
    """The caller's context in `carrier` (HTTP headers, gRPC metadata as a dict: `.get` by lowercase name)."""
    if not propagation.tracecontext:
        return None
    parsed = parse_traceparent(carrier.get(TRACEPARENT))
    if parsed is None:
        return None
    baggage = (carrier.get(BAGGAGE) or "") if propagation.baggage else ""
    return RemoteContext(*parsed, carrier.get(TRACESTATE) or "", baggage)


def traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    """The W3C traceparent header (ints to hex through bytes: a third of a format spec's instructions)."""
    return "-".join(("00", trace_id.to_bytes(16, "big").hex(), span_id.to_bytes(8, "big").hex(),
                     "01" if sampled else "00"))
