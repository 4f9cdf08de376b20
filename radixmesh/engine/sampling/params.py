"""Per-request sampling parameters (SGLang's `sampling_params` dict, same names and defaults), validated at the edge."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request is decoded greedily (as SGLang does).
GREEDY_EPS = 1e-6
_STRUCTURED = ("json_schema", "regex", "ebnf")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Structured outputs of reasoning models: the constraint binds the answer only. The output is free up to and
    # including reasoning_end_token_id (the end of the thinking); with reasoning_start_token_id too, the output
    # starts in its answer but may open its thinking with that token as its first token (else it starts thinking).
    reasoning_end_token_id: int | None = None
    reasoning_start_token_id: int | None = None

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
        _int_field("max_new_tokens", self.max_new_tokens, low=0)
        _int_field("min_new_tokens", self.min_new_tokens, low=0)
        _int_field("n", self.n, low=1)
        _int_field("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1, got 0")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                             f"({self.max_new_tokens})")
        _float_field("temperature", self.temperature, 0.0, None)
        _float_field("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _float_field("min_p", self.min_p, 0.0, 1.0)
        _float_field("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float_field("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float_field("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        if self.sampling_seed is not None:
            _int_field("sampling_seed", self.sampling_seed, low=0)
            top = 2**63 - 1 - (self.n - 1)  # sample j of n draws with seed + j, a signed 64-bit integer on the device
            if self.sampling_seed > top:
                raise ValueError(f"sampling_seed must be at most {top} with n = {self.n} (sample j draws with seed + "
                                 f"j, a signed 64-bit integer), got {self.sampling_seed}")
        for name in ("reasoning_end_token_id", "reasoning_start_token_id"):
            if getattr(self, name) is not None:
                _int_field(name, getattr(self, name), low=0)
        if self.reasoning_start_token_id is not None and self.reasoning_end_token_id is None:
            raise ValueError("reasoning_start_token_id needs reasoning_end_token_id")


def _int_field(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _float_field(name: str, value: Any, low: float, high: float | None, low_open: bool = False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and value > high):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high if high is not None else 'inf'}], got {value}")


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
