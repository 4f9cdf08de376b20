"""The sampling field table (engine.sampling.fields, declared by SamplingParams): every row is a proto field of the
same name, its bounds are enforced by the engine with the documented message, its OpenAI aliases map onto it, and
the OpenAPI schemas built from it accept exactly what the parsers accept, on values either side of every bound."""

from __future__ import annotations

import jsonschema
import pytest
from google.protobuf.descriptor import FieldDescriptor

from radixmesh.engine.sampling.fields import Api, Kind
from radixmesh.engine.sampling.params import BY_NAME, FIELDS, MAX_N, SamplingParams
from radixmesh.services.router import convert
from radixmesh.services.router.openai_errors import OpenAIError
from radixmesh.services.router.openai_request import parse_completion
from radixmesh.services.router.openapi import document
from radixmesh.services.router.sampling_fields import api_high, wire_range
from radixmesh.services.worker.convert import sampling_dict
from radixmesh.v1 import common_pb2

SERVED = {"m"}
_PROTO = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
_PROTO_TYPES = {Kind.INT: {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64},
                Kind.FLOAT: {FieldDescriptor.TYPE_DOUBLE}, Kind.BOOL: {FieldDescriptor.TYPE_BOOL}}
NUMERIC = [row for row in FIELDS if row.kind is not Kind.BOOL]


def _optional_scalar(field) -> bool:
    """A proto3 `optional` field: it has presence through a synthetic oneof of its own (`_<name>`)."""
    oneof = field.containing_oneof
    return not field.is_repeated and field.has_presence and oneof is not None and oneof.name == "_" + field.name


def test_every_row_is_an_optional_proto_field_of_the_same_name_and_kind():
    for row in FIELDS:
        assert _optional_scalar(_PROTO[row.name]) and _PROTO[row.name].type in _PROTO_TYPES[row.kind], row.name
    # and every such field of the message is a row (stop, stop_token_ids, logit_bias and the constraint are not)
    assert {f.name for f in _PROTO.values() if _optional_scalar(f)} == set(BY_NAME)


def test_rows_carry_the_dataclass_defaults_and_names():
    defaults = SamplingParams()
    assert [row.name for row in FIELDS][:3] == ["max_new_tokens", "min_new_tokens", "temperature"]
    for row in FIELDS:
        assert getattr(defaults, row.name) == row.default
        assert row.engine_error(row.default) is None


def _outside(row) -> list:
    """Values just past each of the row's bounds (and in its gap)."""
    out = []
    step = 1 if row.kind is Kind.INT else 1e-3
    if row.lowest is not None:
        out.append(row.lowest if row.low_open else row.lowest - step)
    if row.high is not None:
        out.append(row.high + step)
    if row.off is not None:
        out += list(range(row.off + 1, row.low))
    return out


def _inside(row) -> list:
    out = [row.default] if row.default is not None else []
    if row.lowest is not None and not row.low_open:
        out.append(row.lowest)
    if row.high is not None:
        out.append(row.high)
    return out


@pytest.mark.parametrize("row", NUMERIC, ids=lambda r: r.name)
def test_the_engine_enforces_every_bound_with_the_documented_message(row):
    for value in _inside(row):
        params = {row.name: value, **({"reasoning_end_token_id": 1} if row.name == "reasoning_start_token_id" else {})}
        assert getattr(SamplingParams.from_dict(params), row.name) == value
    for value in _outside(row):
        with pytest.raises(ValueError) as e:
            SamplingParams.from_dict({row.name: value})
        message = str(e.value)
        if row.in_gap(value):
            assert message == f"{row.name} must be {row.off} (disabled) or >= {row.low}, got {value}"
        elif row.kind is Kind.INT:
            assert message == f"{row.name} must be >= {row.lowest}, got {value}"
        else:
            assert message == f"{row.name} must be in {row.bounds()}, got {value}"
    with pytest.raises(ValueError, match=f"^{row.name} must be an? (integer|number), got 'x'$"):
        SamplingParams.from_dict({row.name: "x"})


def test_known_engine_messages():
    cases = {"top_k": (0, "top_k must be -1 (disabled) or >= 1, got 0"),
             "top_p": (0.0, "top_p must be in (0.0, 1.0], got 0.0"), "n": (0, "n must be >= 1, got 0"),
             "temperature": (-1, "temperature must be in [0.0, inf], got -1"),
             "sampling_seed": (-3, "sampling_seed must be >= 0, got -3")}
    for name, (value, message) in cases.items():
        with pytest.raises(ValueError) as e:
            SamplingParams.from_dict({name: value})
        assert str(e.value) == message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_the_engine_refuses_non_finite_numbers(value):
    """NaN passes every bound check and would poison the whole batch's sampling; infinities are no temperature."""
    for row in NUMERIC:
        if row.kind is Kind.FLOAT:
            with pytest.raises(ValueError) as e:
                SamplingParams.from_dict({row.name: value})
            assert str(e.value) == f"{row.name} must be a finite number, got {value}"


def test_flags_take_any_value_in_the_engine_as_sglang_does():
    assert SamplingParams.from_dict({"ignore_eos": 1}).ignore_eos == 1


def test_openai_aliases():
    sp = parse_completion({"prompt": "x", "max_completion_tokens": 3, "max_tokens": 9, "min_tokens": 2,
                           "seed": 11}, SERVED).sampling
    assert (sp.max_new_tokens, sp.min_new_tokens, sp.sampling_seed) == (3, 2, 11)
    assert parse_completion({"prompt": "x", "max_tokens": 9}, SERVED).sampling.max_new_tokens == 9
    with pytest.raises(OpenAIError) as e:  # every alias given is checked, not only the one that wins
        parse_completion({"prompt": "x", "max_completion_tokens": 3, "max_tokens": -1}, SERVED)
    assert e.value.param == "max_tokens"
    # SGLang's names are not OpenAI fields: unknown fields are ignored there
    body = {"prompt": "x", "max_new_tokens": 5, "sampling_seed": 3, "min_new_tokens": 1}
    sp = parse_completion(body, SERVED).sampling
    assert not any(sp.HasField(name) for name in ("max_new_tokens", "sampling_seed", "min_new_tokens"))
    assert BY_NAME["max_new_tokens"].openai_names == ("max_completion_tokens", "max_tokens")
    assert BY_NAME["temperature"].openai_names == ("temperature",)


def test_the_apis_column():
    engine_only = [row.name for row in FIELDS if row.apis == {Api.ENGINE}]
    assert engine_only == ["reasoning_end_token_id", "reasoning_start_token_id"]
    with pytest.raises(ValueError, match="unsupported sampling parameter"):
        convert.sampling_params({"reasoning_end_token_id": 3})
    assert not parse_completion({"prompt": "x", "reasoning_end_token_id": 3}, SERVED).sampling.HasField(
        "reasoning_end_token_id")
    assert SamplingParams.from_dict({"reasoning_end_token_id": 3}).reasoning_end_token_id == 3
    schema = document()["components"]["schemas"]["SamplingParams"]["properties"]
    assert "reasoning_end_token_id" not in schema and "n" in schema


def test_the_proto_mapping_is_generic_both_ways():
    given = {"max_new_tokens": 7, "top_k": 3, "temperature": 0.5, "ignore_eos": True, "n": 2, "sampling_seed": 9}
    sp = convert.sampling_params(given)
    sp.reasoning_end_token_id = 4  # set by the router itself, carried to the worker
    assert sampling_dict(sp) == {**given, "reasoning_end_token_id": 4}
    assert sampling_dict(common_pb2.SamplingParams()) == {}


def test_api_bounds_add_the_proto_width_and_the_apis_cap():
    assert wire_range(BY_NAME["max_new_tokens"]) == (-(2**31 - 1), 2**31 - 1)
    assert wire_range(BY_NAME["sampling_seed"]) == (-2**63, 2**63 - 1)
    assert api_high(BY_NAME["n"]) == MAX_N and api_high(BY_NAME["sampling_seed"]) == 2**63 - 1
    assert api_high(BY_NAME["top_p"]) == 1.0 and api_high(BY_NAME["temperature"]) is None


def test_generate_refuses_an_integer_too_large_for_a_float():
    """It raised OverflowError (a 500) where a finite number is expected."""
    for body in ({"temperature": 10**400}, {"logit_bias": {"5": 10**400}}):
        with pytest.raises(ValueError, match="must be a finite number"):
            convert.sampling_params(body)


# ---- the OpenAPI schemas built from the table against the parsers -----------------------------------------------
def _validator(name: str) -> jsonschema.Draft202012Validator:
    doc = document()
    return jsonschema.Draft202012Validator({**doc["components"]["schemas"][name], "components": doc["components"]})


def _probes(row) -> list:
    values = ["x", True, None, 1.5]
    if row.kind is Kind.BOOL:
        return values + [False, 0, 1]
    values += _inside(row) + _outside(row)
    high = api_high(row)
    if high is not None:
        values += [high, high + (1 if row.kind is Kind.INT else 1e-3)]
    if row.kind is Kind.INT:
        low, top = wire_range(row)
        values += [low - 1, low, top, top + 1, 5.0]
    return values


def _openai_takes(name: str, value) -> bool:
    try:
        parse_completion({"prompt": "x", name: value}, SERVED)
    except OpenAIError as e:
        assert e.status == 400 and e.param == name, (name, value, e)
        return False
    return True


def _generate_takes(name: str, value) -> bool:
    """The router's check, then the worker's engine's (a 400 either way); min_new_tokens is probed under the
    largest max_new_tokens (min_new_tokens <= max_new_tokens is a rule across fields)."""
    roomy = {"max_new_tokens": 2**31 - 1} if name == "min_new_tokens" else {}
    try:
        SamplingParams.from_dict(sampling_dict(convert.sampling_params({name: value, **roomy})))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("row", [row for row in FIELDS if Api.OPENAI in row.apis], ids=lambda r: r.name)
def test_openai_schema_takes_what_the_parser_takes(row):
    validator = _validator("CompletionRequest")
    for name in row.openai_names:
        for value in _probes(row):
            body = {"prompt": "x", name: value}
            assert validator.is_valid(body) == _openai_takes(name, value), (name, value)


@pytest.mark.parametrize("row", [row for row in FIELDS if Api.GENERATE in row.apis], ids=lambda r: r.name)
def test_generate_schema_takes_what_the_router_and_engine_take(row):
    validator = _validator("SamplingParams")
    for value in _probes(row):
        if row.kind is Kind.INT and isinstance(value, float) and value.is_integer():
            continue  # 5.0 is an integer to JSON schema; sampling_params, as SGLang's, wants 5
        assert validator.is_valid({row.name: value}) == _generate_takes(row.name, value), (row.name, value)
