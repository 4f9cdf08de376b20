"""The router's request bodies (services/router/http_common.parse_json): orjson where it gives json.loads's value,
json.loads where it would not (integers past 64 bits, NaN and Infinity, floats past the double range, lone
surrogate escapes, deep nesting, UTF-16 bodies), so every body parses to exactly what json.loads makes of it, and
every body json.loads refuses is refused."""

from __future__ import annotations

import json
import math

import pytest

from radixmesh.services.router.http_common import parse_json

SAME = [
    b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 16, "temperature": 0.7}, "stream": true}',
    b'{"text": "caf\\u00e9 \\ud83d\\ude00 \xc3\xa9", "n": -0, "f": 1e5, "g": 1.0000000000000000000001, "z": null}',
    b'{"a": 1, "a": 2}', b" [1] ", b'"\\u0000"', b"123456789012345678", b"-123456789012345678",
    b"12345678901234567890123", b'{"big": 18446744073709551616, "bigger": -99999999999999999999999}',
    b'{"text": "call 1234567890123456789012 now"}', b"[NaN, Infinity, -Infinity]", b"[1e400, -1e400]",
    b'"\\ud800"', '{"t": "h\u00e9"}'.encode("utf-16"), b"\xef\xbb\xbf{}", b"0.1", b"5e-324",
]
REFUSED = [b"", b"{", b'"a\x01b"', b"[1,]", b"01", b"+1", b"tru", b"[1] x", b"\xff\xfe\xfd"]


@pytest.mark.parametrize("raw", SAME)
def test_the_value_is_json_loads_s(raw):
    want = json.loads(raw)
    got = parse_json(raw)
    assert repr(got) == repr(want) and type(got) is type(want)


def test_big_integers_stay_integers_and_nan_stays_nan():
    assert parse_json(b'{"id": 18446744073709551616}')["id"] == 1 << 64
    assert math.isnan(parse_json(b"[NaN]")[0]) and parse_json(b"[1e400]")[0] == math.inf


def test_nesting_past_the_decoders_limit_is_json_loads_s_recursion_error():
    deep = b"[" * 1500 + b"]" * 1500  # orjson stops at 1024 levels; json_body answers json.loads's RecursionError
    with pytest.raises(RecursionError):
        parse_json(deep)


@pytest.mark.parametrize("raw", REFUSED)
def test_what_json_loads_refuses_is_refused(raw):
    with pytest.raises(ValueError):  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        json.loads(raw)
    with pytest.raises(ValueError):
        parse_json(raw)
