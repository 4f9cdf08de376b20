"""Per-request sampling parameters (SGLang's `sampling_params` dict, same names and defaults), validated at the edge.

The scalar fields are declared with their rows of the field table (engine.sampling.fields): bounds, OpenAI names
and APIs there drive validation here and the router's parsing, OpenAPI schemas and proto mapping."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from radixmesh.engine.sampling.fields import Api, flag, integer, number, rows

# Below this temperature a request is decoded greedily (as SGLang does).
GREEDY_EPS = 1e-6
_STRUCTURED = ("json_schema", "regex", "ebnf")
INT64_MAX = 2**63 - 1
# n samples cost n requests' work on one worker, so the serving APIs bound n (a huge n would keep a worker busy for
# minutes); the engine does not.
MAX_N = 128
_SEED = "sample j of n draws with seed + j, which must stay at most 2**63 - 1"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = integer(128, low=0, openai=("max_completion_tokens", "max_tokens"))
    min_new_tokens: int = integer(0, low=0, openai=("min_tokens",))
    temperature: float = number(1.0, low=0.0)
    top_p: float = number(1.0, low=0.0, high=1.0, low_open=True)
    top_k: int = integer(-1, off=-1, low=1, description="-1 disables top-k; 0 is refused")
    min_p: float = number(0.0, low=0.0, high=1.0)
    frequency_penalty: float = number(0.0, low=-2.0, high=2.0)
    presence_penalty: float = number(0.0, low=-2.0, high=2.0)
    repetition_penalty: float = number(1.0, low=0.0, high=2.0, low_open=True)
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = flag(False)
    skip_special_tokens: bool = flag(True)
    spaces_between_special_tokens: bool = flag(True)
    no_stop_trim: bool = flag(False)
    n: int = integer(1, low=1, api_high=MAX_N)
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    sampling_seed: int | None = integer(None, low=0, openai=("seed",), description=_SEED)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Structured outputs of reasoning models: the constraint binds the answer only. The output is free up to and
    # including reasoning_end_token_id (the end of the thinking); with reasoning_start_token_id too, the output
    # starts in its answer but may open its thinking with that token as its first token (else it starts thinking).
    # The router sets them (for chat with --reasoning-parser); no HTTP API takes them.
    reasoning_end_token_id: int | None = integer(None, low=0, apis=frozenset({Api.ENGINE}))
    reasoning_start_token_id: int | None = integer(None, low=0, apis=frozenset({Api.ENGINE}))

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, defaults: dict[str, Any] | None = None) -> "SamplingParams":
        """`defaults` (the model's recommended values) fill the keys `d` leaves out."""
        d = {**(defaults or {}), **{k: v for k, v in (d or {}).items() if v is not None}}
        structured = [k for k in _STRUCTURED if k in d]
        if len(structured) > 1:
            raise ValueError(f"give at most one of json_schema, regex and ebnf, got {', '.join(structured)}")
        if "json_schema" in d and isinstance(d["json_schema"], dict):
            d["json_schema"] = json.dumps(d["json_schema"])
        for k in structured:
            if not isinstance(d[k], str) or not d[k]:
                raise ValueError(f"{k} must be a non-empty string, got {d[k]!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in names)
        if unknown:
            raise ValueError(f"unsupported sampling parameter(s): {', '.join(unknown)}; supported: "
                             f"{', '.join(sorted(names))}")
        if "stop" in d:
            d["stop"] = _stop_strings(d["stop"])
        if "stop_token_ids" in d:
            d["stop_token_ids"] = _int_list(d["stop_token_ids"], "stop_token_ids")
        if "logit_bias" in d:
            d["logit_bias"] = _logit_bias(d["logit_bias"])
        params = cls(**d)
        params.validate()
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field, text) of the structured-output constraint, if any."""
        for k in _STRUCTURED:
            if getattr(self, k) is not None:
                return k, getattr(self, k)
        return None

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        for row in FIELDS:
            error = row.engine_error(getattr(self, row.name))
            if error is not None:
                raise ValueError(error)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                             f"({self.max_new_tokens})")
        if self.sampling_seed is not None:
            top = INT64_MAX - (self.n - 1)  # sample j of n draws with seed + j, a signed 64-bit integer on the device
            if self.sampling_seed > top:
                raise ValueError(f"sampling_seed must be at most {top} with n = {self.n} (sample j draws with seed + "
                                 f"j, a signed 64-bit integer), got {self.sampling_seed}")
        if self.reasoning_start_token_id is not None and self.reasoning_end_token_id is None:
            raise ValueError("reasoning_start_token_id needs reasoning_end_token_id")


# The field table: SamplingParams' scalar fields in declaration order, and by name.
FIELDS = rows(SamplingParams)
BY_NAME = {row.name: row for row in FIELDS}


def _stop_strings(value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {value!r}")
    return tuple(items)


def _int_list(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    return tuple(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """SGLang/OpenAI form: {"token id": bias}; keys may be ints or digit strings."""
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {value!r}")
    out = []
    for k, v in value.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias key {k!r} is not a token id") from None
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"logit_bias value for token {tok} must be a number, got {v!r}")
        out.append((tok, float(v)))
    return tuple(out)
