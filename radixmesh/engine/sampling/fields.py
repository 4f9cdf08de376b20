"""The sampling parameters' field table: one row per scalar field (integer, number or flag) with its default, its
bounds, the names OpenAI bodies give it and the APIs that take it.

SamplingParams (engine.sampling.params) declares each scalar field with `integer`, `number` or `flag`, so the
dataclass is the table and `rows(SamplingParams)` reads it. Everything else is driven by it:
  - the engine's validation of a SamplingParams (`Row.engine_error`),
  - the router's parsing of OpenAI bodies and of SGLang's `sampling_params` (services.router.sampling_fields adds
    what only the router knows: the widths of the proto fields and the OpenAI/SGLang error shapes),
  - the sampling properties of both request schemas in the router's OpenAPI document,
  - the proto <-> engine mapping in both convert.py files: every row is a proto3 `optional` field of the same name
    in radixmesh.v1.SamplingParams (a unit test holds the two together).
So a new scalar field is its row, its proto field and the code that uses it (the sampler, usually).

Fields that are not scalars keep code of their own: `stop` (a string or a list of them), `stop_token_ids` (token
ids), `logit_bias` (a map whose keys are token ids written as strings) and the structured-output constraint
(`json_schema`/`regex`/`ebnf`: a proto oneof, at most one given, a schema given as an object in SGLang's API and as
`response_format` in OpenAI's). Rules across fields stay with their owners too: min_new_tokens <= max_new_tokens,
and a seed whose last sample (seed + n - 1) still fits a signed 64-bit integer.

Error shapes (the message names the field; `{bounds}` as `Row.bounds` writes them):
  engine:             `{name} must be an integer, got {value!r}`, `{name} must be >= {low}, got {value}`,
                      `{name} must be a number, got {value!r}`, `{name} must be a finite number, got {value}`,
                      `{name} must be in {bounds}, got {value}`; flags
                      are not checked (SGLang's engine takes any value)
  OpenAI (HTTP 400):  `'{openai name}' must be in {bounds}, got {value as JSON}` (param: that name)
  both, in a gap:     `... must be {off} (disabled) or >= {low}, got {value}`
  SGLang /generate:   `sampling_params.{name} must be an integer, got {value!r}`, `... must be in [low, high], got
                      {value}` (types and proto widths, and the whole range of a row with `api_high`; the worker's
                      engine checks the other bounds and answers with the engine's message)"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any


class Kind(enum.Enum):
    INT = "integer"
    FLOAT = "number"
    BOOL = "boolean"


class Api(enum.Enum):
    """Where a field can be given."""

    ENGINE = "engine"  # Engine.generate's sampling_params, and the proto message (which carries every row)
    GENERATE = "generate"  # SGLang's POST /generate `sampling_params`
    OPENAI = "openai"  # /v1/chat/completions and /v1/completions bodies


EVERY_API = frozenset(Api)
_ROW = "radixmesh.sampling_row"  # the dataclasses.field metadata key that holds a field's Row


@dataclass(frozen=True, slots=True)
class Row:
    """One scalar sampling field. Bounds are the engine's (None: unbounded); an integer proto field's width bounds
    it further at the router."""

    kind: Kind
    default: Any  # None: unset unless given (no value means "off")
    low: int | float | None = None
    high: int | float | None = None
    low_open: bool = False  # `low` itself is refused (top_p, repetition_penalty)
    off: int | None = None  # a value below `low` that disables the option and is accepted too (top_k's -1)
    api_high: int | None = None  # integers: a bound of the serving APIs the engine does not impose (a request's cost)
    openai: tuple[str, ...] = ()  # names in OpenAI bodies, the first given wins (all are checked); (): the name
    apis: frozenset[Api] = EVERY_API
    description: str | None = None  # for the OpenAPI document
    name: str = ""  # the SamplingParams attribute (filled in by `rows`)

    @property
    def openai_names(self) -> tuple[str, ...]:
        return self.openai or (self.name,)

    @property
    def lowest(self) -> int | float | None:
        """The least value accepted: `off` where the field has one."""
        return self.off if self.off is not None else self.low

    def bounds(self, high: int | float | None = None) -> str:
        """`[low, high]` with `(` for an open low end and `inf` for no high end; `high` overrides the row's."""
        top = self.high if high is None else high
        return f"{'(' if self.low_open else '['}{self.lowest}, {'inf' if top is None else top}]"

    def in_gap(self, value: int) -> bool:
        """Between `off` and `low`, both excluded (top_k's 0)."""
        return self.off is not None and self.off < value < self.low

    @property
    def gap_rule(self) -> str:
        return f"must be {self.off} (disabled) or >= {self.low}"

    def out_of_bounds(self, value: int | float, high: int | float | None = None) -> bool:
        """Whether `value` (of the right type) is outside [lowest, high] (`high` overrides the row's)."""
        top = self.high if high is None else high
        low = self.lowest
        return ((low is not None and (value < low or (self.low_open and value == low)))
                or (top is not None and value > top))

    def engine_error(self, value: Any) -> str | None:
        """Why the engine refuses `value` for this field, or None. Flags take any value, as SGLang's do."""
        if value is None and self.default is None or self.kind is Kind.BOOL:
            return None
        if self.kind is Kind.INT:
            if not isinstance(value, int) or isinstance(value, bool):
                return f"{self.name} must be an integer, got {value!r}"
            if self.out_of_bounds(value):
                shown = f">= {self.lowest}" if self.high is None else f"in {self.bounds()}"
                return f"{self.name} must be {shown}, got {value}"
            return f"{self.name} {self.gap_rule}, got {value}" if self.in_gap(value) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"{self.name} must be a number, got {value!r}"
        if not math.isfinite(value):  # NaN passes every bound check and poisons the whole batch's sampling
            return f"{self.name} must be a finite number, got {value}"
        return f"{self.name} must be in {self.bounds()}, got {value}" if self.out_of_bounds(value) else None


def _row(kind: Kind, default: Any, **spec: Any) -> Any:
    return dataclasses.field(default=default, metadata={_ROW: Row(kind, default, **spec)})


def integer(default: int | None, **spec: Any) -> Any:
    """A SamplingParams integer field (a proto int32 or int64); `spec`: Row's fields."""
    return _row(Kind.INT, default, **spec)


def number(default: float, **spec: Any) -> Any:
    """A SamplingParams float field (a proto double); `spec`: Row's fields."""
    return _row(Kind.FLOAT, default, **spec)


def flag(default: bool, **spec: Any) -> Any:
    """A SamplingParams boolean field (a proto bool); `spec`: Row's fields."""
    return _row(Kind.BOOL, default, **spec)


def rows(params_class: type) -> tuple[Row, ...]:
    """The table: the rows of `params_class`'s scalar fields, in declaration order, named."""
    return tuple(dataclasses.replace(f.metadata[_ROW], name=f.name) for f in dataclasses.fields(params_class)
                 if _ROW in f.metadata)
