"""engine.sampling.grammar.bounded_strings_as_patterns: the xgrammar 0.2.8 work-around rewrites exactly the string
schemas with a length bound (and nothing else), everywhere in the schema."""

from __future__ import annotations

import json
import re

from engine.sampling.grammar import _PLAIN_CHAR, bounded_strings_as_patterns


def test_bounded_strings_become_patterns_everywhere():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 5},
        "b": {"type": ["string", "null"], "minLength": 2},
        "c": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 3}},
        "d": {"anyOf": [{"$ref": "#/$defs/s"}, {"type": "integer", "maximum": 3}]},
    }, "$defs": {"s": {"type": "string", "maxLength": 0}}}
    out = json.loads(bounded_strings_as_patterns(json.dumps(schema)))
    props = out["properties"]
    assert props["a"] == {"type": "string", "pattern": f"^{_PLAIN_CHAR}{{0,5}}$"}
    assert props["b"] == {"type": ["string", "null"], "pattern": f"^{_PLAIN_CHAR}{{2,}}$"}
    assert props["c"]["items"] == {"type": "string", "pattern": f"^{_PLAIN_CHAR}{{1,3}}$"}
    assert out["$defs"]["s"] == {"type": "string", "pattern": f"^{_PLAIN_CHAR}{{0,0}}$"}
    assert props["d"]["anyOf"][1] == {"type": "integer", "maximum": 3}


def test_what_xgrammar_gets_right_is_left_alone():
    for schema in ({"type": "string"}, {"type": "string", "maxLength": 4, "pattern": "^a+$"},
                   {"type": "string", "maxLength": 9, "format": "email"}, {"type": "string", "enum": ["x"],
                                                                            "maxLength": 2},
                   {"type": "integer", "maxLength": 3}, {"type": "string", "maxLength": -1},
                   {"type": "string", "maxLength": True}):
        spec = json.dumps(schema)
        assert bounded_strings_as_patterns(spec) is spec
    assert bounded_strings_as_patterns("{not json") == "{not json"


def test_the_character_class_is_json_without_escapes():
    one = re.compile(_PLAIN_CHAR)
    for ch in ("a", " ", "~", "\x7f", "é", "中", "🙂", "\ue000"):
        assert one.fullmatch(ch), repr(ch)
    for ch in ('"', "\\", "\x00", "\x01", "\t", "\n", "\x1f", "\ud800", "\udfff"):
        assert not one.fullmatch(ch), repr(ch)
