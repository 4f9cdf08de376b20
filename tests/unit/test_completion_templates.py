"""Fill-in-the-middle for /v1/completions' suffix (--completion-template): the built-in templates and JSON files
render as the models expect, and a suffix without a template, or with token-id prompts, is a 400 naming it."""

from __future__ import annotations

import json

import pytest

from radixmesh.services.router.completion_templates import BUILTIN, load_completion_template
from radixmesh.services.router.openai_errors import OpenAIError
from radixmesh.services.router.openai_request import parse_completion
from tests.unit.openai_jobs import SERVED


def test_builtin_templates_put_the_middle_token_where_the_model_generates():
    assert BUILTIN["qwen_coder"].render("def f(", "\n    return x") == \
        "<|fim_prefix|>def f(<|fim_suffix|>\n    return x<|fim_middle|>"
    assert BUILTIN["star_coder"].render("a", "b") == "<fim_prefix>a<fim_suffix>b<fim_middle>"
    assert BUILTIN["deepseek_coder"].render("a", "b") == "<｜fim▁begin｜>a<｜fim▁hole｜>b<｜fim▁end｜>"


@pytest.mark.parametrize("position, rendered", [("MIDDLE", "<B>p<M>s<E>"), ("end", "<B>p<E>s<M>")])
def test_a_json_file_is_a_template(tmp_path, position, rendered):
    path = tmp_path / f"fim-{position}.json"
    path.write_text(json.dumps({"name": "mine", "fim_begin_token": "<B>", "fim_middle_token": "<M>",
                                "fim_end_token": "<E>", "fim_position": position}))
    template = load_completion_template(str(path))
    assert template.name == "mine" and template.render("p", "s") == rendered


@pytest.mark.parametrize("content, words", [
    ("{nope", "not a readable JSON file"),
    ("[1]", "expected a JSON object"),
    (json.dumps({"name": "x", "fim_begin_token": "<B>", "fim_middle_token": "", "fim_end_token": "<E>",
                 "fim_position": "END"}), "fim_middle_token must be non-empty"),
    (json.dumps({"name": "x", "fim_begin_token": "<B>", "fim_middle_token": "<M>", "fim_end_token": "<E>",
                 "fim_position": "START"}), "fim_position must be MIDDLE or END"),
])
def test_bad_template_files_are_clear_errors(tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=words):
        load_completion_template(str(path))
    with pytest.raises(ValueError, match="deepseek_coder, star_coder, qwen_coder or a JSON file"):
        load_completion_template("no-such-template")


def test_a_suffix_renders_each_text_prompt_and_echo_shows_the_prompt():
    job = parse_completion({"model": "tiny", "prompt": ["def f(", "x = "], "suffix": ")\n"}, SERVED,
                           BUILTIN["qwen_coder"])
    assert [p.tokenize.text for p in job.prompts] == ["<|fim_prefix|>def f(<|fim_suffix|>)\n<|fim_middle|>",
                                                      "<|fim_prefix|>x = <|fim_suffix|>)\n<|fim_middle|>"]
    assert [p.shown for p in job.prompts] == ["def f(", "x = "]
    plain = parse_completion({"model": "tiny", "prompt": "def f(", "suffix": ""}, SERVED, BUILTIN["qwen_coder"])
    assert plain.prompts[0].tokenize.text == "def f(" and plain.prompts[0].shown is None


@pytest.mark.parametrize("body, template, words", [
    ({"prompt": "x", "suffix": "y"}, None, "--completion-template"),
    ({"prompt": [1, 2], "suffix": "y"}, BUILTIN["qwen_coder"], "needs text prompts"),
    ({"prompt": ["x", [1, 2]], "suffix": "y"}, BUILTIN["qwen_coder"], "needs text prompts"),
    ({"prompt": "x", "suffix": 3}, BUILTIN["qwen_coder"], "must be a string"),
])
def test_bad_suffix_is_a_400_naming_it(body, template, words):
    with pytest.raises(OpenAIError) as e:
        parse_completion({"model": "tiny", **body}, SERVED, template)
    assert (e.value.status, e.value.param) == (400, "suffix") and words in e.value.message, e.value.message
