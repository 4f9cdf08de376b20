"""Typed reads of a JSON request body's fields, for the router's HTTP endpoints (OpenAI and SGLang's utility and
embedding endpoints): every rejection is an OpenAIError(400) whose message and `param` name the field, with the
offending value shown; an unknown model is a 404."""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from typing import Any

from radixmesh.engine.results import all_ints
from radixmesh.services.router.openai_errors import OpenAIError, bad_request, not_found, unavailable

INT32_MAX = 2**31 - 1


class Fields:
    """Typed reads of optional JSON fields; a missing key and null both read as None."""

    def __init__(self, body: dict[str, Any], prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix

    def param(self, name: str) -> str:
        return self.prefix + name

    def fail(self, name: str, what: str) -> OpenAIError:
        value = self.body.get(name)
        return bad_request(f"'{self.param(name)}' {what}, got {show(value)}", param=self.param(name))

    def bool(self, name: str) -> bool | None:
        value = self.body.get(name)
        if value is not None and not isinstance(value, bool):
            raise self.fail(name, "must be a boolean")
        return value

    def str(self, name: str) -> str | None:
        value = self.body.get(name)
        if value is not None and not isinstance(value, str):
            raise self.fail(name, "must be a string")
        return value

    def int(self, name: str, low: int = 0, high: int = INT32_MAX) -> int | None:
        value = self.body.get(name)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(name, "must be an integer")
        if not low <= value <= high:
            raise self.fail(name, f"must be in [{low}, {high}]")
        return value

    def number(self, name: str, low: float, high: float | None = None, low_open: bool = False) -> float | None:
        value = self.body.get(name)
        if value is None:
            return None
        try:
            finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        except OverflowError:  # an integer literal too large for a float
            finite = False
        if not finite:
            raise self.fail(name, "must be a number")
        if value < low or (low_open and value == low) or (high is not None and value > high):
            raise self.fail(name, f"must be in {'(' if low_open else '['}{low}, {'inf' if high is None else high}]")
        return float(value)

    def object(self, name: str) -> dict[str, Any] | None:
        value = self.body.get(name)
        if value is not None and not isinstance(value, dict):
            raise self.fail(name, "must be a JSON object")
        return value

    def list(self, name: str) -> list[Any] | None:
        value = self.body.get(name)
        if value is not None and not isinstance(value, list):
            raise self.fail(name, "must be a list")
        return value


def show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, (bytes, bytearray)) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= INT32_MAX


def are_token_ids(values: list) -> bool:
    """Whether every item is a token id (is_token_id), without a Python step per id (a prompt may hold thousands)."""
    return all_ints(values) and (not values or (min(values) >= 0 and max(values) <= INT32_MAX))


def token_key(key: Any) -> int | None:
    """The token id a logit_bias key names (ASCII decimal digits: not int()'s spaces, signs, underscores or other
    scripts' digits), or None; the id may still be out of range."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12:
        return int(key)
    return None


def body_fields(body: Any) -> Fields:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return Fields(body)


def served_model(f: Fields, served_models: Collection[str], adapters: Collection[str] = ()) -> str:
    """The body's `model` (absent: the served one): a served model, SGLang's `<served model>:<adapter>` or a
    loaded LoRA adapter's name (adapter_of_model); a 404 for anything else, a 503 before any worker said what it
    serves."""
    name = f.str("model")
    if not served_models:  # no worker has said what it serves yet
        raise unavailable("no model is being served yet")
    if name is None:
        return served_models[0] if isinstance(served_models, (list, tuple)) else min(served_models)
    if adapter_of_model(name, served_models, adapters) is None:
        served = ", ".join([*sorted(served_models), *sorted(adapters)]) or "none"
        raise not_found(f"The model '{name}' does not exist; this server serves: {served}", param="model",
                        code="model_not_found")
    return name


def adapter_of_model(model: str, served_models: Collection[str], adapters: Collection[str] = ()) -> str | None:
    """The LoRA adapter a request's `model` runs with: "" for a served model (the base model, also when empty), the
    adapter of SGLang's `<served model>:<adapter>` (whether loaded or not: routing says), an adapter's own name
    among `adapters`; None when it names none of these."""
    if not model or model in served_models:
        return ""
    if model in adapters:
        return model
    for served in served_models:
        if model.startswith(served + ":") and len(model) > len(served) + 1:
            return model[len(served) + 1:]
    return None
