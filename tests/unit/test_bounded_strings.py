"""engine.sampling.grammar.bounded_strings_as_patterns: the xgrammar 0.2.8 work-around rewrites exactly the string
schemas with a length bound (and nothing else), everywhere in the schema."""

from __future__ import annotations

import json
from radixmesh.engine.sampling.grammar import _PLAIN_CHAR, bounded_strings_as_patterns
from tests.conftest import model_path


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


def test_the_character_class_is_exact_utf8_without_escapes(capfd):
    """As xgrammar reads it (its regex, not Python's), byte by byte: every character a JSON string may hold
    unescaped, up to U+10FFFF, in its one valid UTF-8 encoding, and nothing else. (Written as one class,
    xgrammar also took overlong encodings; written \\U0010ffff, it read the letter U.)"""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_path("tiny-qwen3")))
    schema = json.dumps({"type": "string", "pattern": f"^{_PLAIN_CHAR}$"})
    compiled = xgr.GrammarCompiler(info).compile_json_schema(schema, any_whitespace=False)
    assert "not recognized" not in capfd.readouterr().err  # every escape in the class means what it says

    def one(encoded: bytes) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(b'"' + encoded + b'"')

    for ch in ("a", "U", "0", " ", "~", "\x7f", "\x80", "é", "\u07ff", "\u0800", "中", "\ud7ff", "\ue000",
               "\uffff", "\U00010000", "🙂", "\U0010ffff"):
        assert one(ch.encode()), repr(ch)
    for ch in ('"', "\\", "\x00", "\x01", "\t", "\n", "\x1f"):
        assert not one(ch.encode()), repr(ch)
    for raw in (b"\xc1\x81", b"\xe0\x96\xb3", b"\xf0\x8f\xbf\xbf",  # overlong
                b"\xed\xa0\x80", b"\xed\xbf\xbf",  # UTF-16 surrogates
                b"\xf4\x90\x80\x80", b"\x80", b"\xff"):  # above U+10FFFF, a lone continuation, never UTF-8
        assert not one(raw), raw
