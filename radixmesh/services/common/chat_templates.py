"""Chat template overrides (`--chat-template`): a Jinja file, a JSON file holding one, or a built-in name.

Built-in templates receive what Hugging Face templates receive: `messages` (role, content and, when given,
tool_calls / tool_call_id / name), `tools`, `add_generation_prompt`, the special tokens (`bos_token`, ...) and any
chat_template_kwargs.
"""

from __future__ import annotations

import json
import os

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML (<|im_start|>role ... <|im_end|>). Tools go into a leading system turn, followed by the given system
# message's text; assistant tool calls are JSON objects inside <tool_call> tags.
CHATML = (
    "{%- set rest = messages -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- messages[0]['content'] + '\\n\\n' -}}{%- set rest = messages[1:] -%}"
    "{%- endif -%}"
    "{{- 'You can call these functions. To call one, reply with <tool_call>{\"name\": ..., \"arguments\": {...}}'"
    " + '</tool_call>.\\n' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in rest -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '\\n<tool_call>' + ((call['function'] if 'function' in call else call) | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Llama 3 headers (<|start_header_id|>role<|end_header_id|>, turns end with <|eot_id|>), BOS first. Tool results
# use Llama 3.1's `ipython` role; tools are listed in a leading system turn.
LLAMA_3 = (
    "{{- bos_token -}}"
    "{%- set rest = messages -%}"
    "{%- if tools -%}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{- (messages[0]['content'] | trim) + '\\n\\n' -}}{%- set rest = messages[1:] -%}"
    "{%- endif -%}"
    "{{- 'You can call these functions. To call one, reply with only {\"name\": ..., \"parameters\": {...}}.\\n' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endif -%}"
    "{%- for message in rest -%}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] -%}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + ((message['content'] or '') | trim) -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if 'function' in call else call -%}"
    "{{- {'name': fn['name'], 'parameters': fn.get('arguments', {})} | tojson -}}"
    "{%- endfor -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

BUILTIN_TEMPLATES: dict[str, str] = {"chatml": CHATML, "llama-3": LLAMA_3}
_TEXT_SUFFIXES = (".jinja", ".jinja2", ".j2", ".txt")


def load_chat_template(spec: str) -> str:
    """The Jinja source named by `spec` (a built-in name or a file); ValueError when it is neither or does not parse."""
    if spec in BUILTIN_TEMPLATES:
        source = BUILTIN_TEMPLATES[spec]
    elif os.path.isfile(spec):
        source = _read_file(spec)
    else:
        raise ValueError(f"--chat-template {spec!r}: no such file and not a built-in template "
                         f"(built-in: {', '.join(BUILTIN_TEMPLATES)})")
    try:
        ImmutableSandboxedEnvironment().parse(source)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {spec!r}: Jinja syntax error on line {e.lineno}: {e.message}") from None
    return source


def _read_file(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.endswith(".json"):
        return _from_json(path, text)
    if path.endswith(_TEXT_SUFFIXES):
        return text
    raise ValueError(f"--chat-template {path!r}: expected a .jinja, .txt or .json file")


def _from_json(path: str, text: str) -> str:
    """A JSON string, or Hugging Face's chat_template.json / tokenizer_config.json layout
    ({"chat_template": "..."} or a list of {"name", "template"} with one named "default")."""
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template {path!r}: invalid JSON: {e}") from None
    if isinstance(loaded, dict):
        loaded = loaded.get("chat_template")
    if isinstance(loaded, list):
        named = {t.get("name"): t.get("template") for t in loaded if isinstance(t, dict)}
        loaded = named.get("default")
    if not isinstance(loaded, str) or not loaded:
        raise ValueError(f"--chat-template {path!r}: expected a JSON string or an object with a 'chat_template' "
                         "string (SGLang's conversation-template JSON is not supported; give a Jinja template)")
    return loaded
