"""The sampling field table (engine.sampling.fields) as the router's APIs see it: the bounds each API checks (an
integer row is also bounded by the width of its proto field), a row's value read from an OpenAI body or from
SGLang's `sampling_params`, and its JSON schema for the OpenAPI document."""

from __future__ import annotations

import math
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from radixmesh.engine.sampling.fields import Api, Kind, Row
from radixmesh.engine.sampling.params import FIELDS
from radixmesh.services.router.request_fields import INT32_MAX, Fields
from radixmesh.v1 import common_pb2

# What a proto integer field holds, as the router checks it (int32's lowest is taken as -INT32_MAX).
_WIDTHS = {FieldDescriptor.TYPE_INT32: (-INT32_MAX, INT32_MAX), FieldDescriptor.TYPE_INT64: (-2**63, 2**63 - 1)}
_PROTO_FIELDS = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name

OPENAI_ROWS = tuple(row for row in FIELDS if Api.OPENAI in row.apis)
GENERATE_ROWS = {row.name: row for row in FIELDS if Api.GENERATE in row.apis}


def wire_range(row: Row) -> tuple[int, int]:
    """The values an integer row's proto field holds."""
    return _WIDTHS[_PROTO_FIELDS[row.name].type]


def api_high(row: Row) -> int | float | None:
    """The highest value the serving APIs take: the row's bound, the APIs' own, and an integer's proto width."""
    if row.kind is not Kind.INT:
        return row.high
    return min(h for h in (row.high, row.api_high, wire_range(row)[1]) if h is not None)


# ---- OpenAI bodies ------------------------------------------------------------------------------------------------
def openai_value(f: Fields, row: Row) -> Any:
    """The row's value in an OpenAI body: under the first of its OpenAI names given (each name given is checked);
    None when none is. Raises OpenAIError(400) naming the field."""
    names = row.openai_names
    if row.kind is Kind.BOOL:
        values = [f.bool(name) for name in names]
    elif row.kind is Kind.FLOAT:
        values = [f.number(name, row.low, row.high, low_open=row.low_open) for name in names]
    else:
        values = [f.int(name, row.lowest, api_high(row)) for name in names]
        for name, value in zip(names, values):
            if value is not None and row.in_gap(value):
                raise f.fail(name, row.gap_rule)
    return next((v for v in values if v is not None), None)


# ---- SGLang's sampling_params (/generate): types and widths; the worker's engine checks the bounds ---------------
def generate_value(row: Row, value: Any) -> Any:
    """`value` of the row checked for its type and proto width (a row the APIs bound, n, for its whole range);
    ValueError names the field."""
    name = row.name
    if row.kind is Kind.BOOL:
        if not isinstance(value, bool):
            raise ValueError(f"sampling_params.{name} must be true or false, got {value!r}")
        return value
    if row.kind is Kind.FLOAT:
        return finite_float(f"sampling_params.{name}", value)
    low, high = (row.lowest, row.api_high) if row.api_high is not None else wire_range(row)
    return checked_int(f"sampling_params.{name}", value, low, high)


def finite_float(what: str, value: Any) -> float:
    try:
        finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def checked_int(what: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{what} must be in [{low}, {high}], got {value}")
    return value


# ---- the OpenAPI document -----------------------------------------------------------------------------------------
def _json_number(x: int | float) -> int | float:
    """Integral bounds as JSON integers (0, not 0.0)."""
    return int(x) if isinstance(x, float) and x.is_integer() else x


def schema(row: Row) -> dict[str, Any]:
    """The JSON schema of the values the APIs take for `row`."""
    out: dict[str, Any] = {"type": row.kind.value}
    if row.kind is Kind.BOOL:
        return out
    low, high = row.lowest, api_high(row)
    if low is not None:
        out["exclusiveMinimum" if row.low_open else "minimum"] = _json_number(low)
    if high is not None:
        out["maximum"] = _json_number(high)
    gap = list(range(row.off + 1, row.low)) if row.off is not None else []
    if gap:
        out["not"] = {"const": gap[0]} if len(gap) == 1 else {"enum": gap}
    if row.description:
        out["description"] = row.description
    return out


def generate_schemas() -> dict[str, dict[str, Any]]:
    """SGLang's sampling_params: name -> schema of every row /generate takes."""
    return {name: schema(row) for name, row in GENERATE_ROWS.items()}


def openai_schemas() -> dict[str, dict[str, Any]]:
    """An OpenAI body's sampling fields: OpenAI name -> schema."""
    return {name: schema(row) for row in OPENAI_ROWS for name in row.openai_names}
