"""Chat prompts: messages + tools rendered by the tokenizer's chat template (or the --chat-template override), in
the tokenizer service and in workers that render chat prompts themselves (GenerateRequest.chat).

Rendering produces text; tokenizing it must not add special tokens again, because templates write BOS themselves.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from dataclasses import dataclass, field
from typing import Any

from radixmesh.v1 import tokenizer_pb2


@dataclass(frozen=True, slots=True)
class ChatSpec:
    """One chat prompt to render. Messages are Hugging Face-style dicts (role, content, optional name, tool_calls
    as a list, tool_call_id)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)


@functools.cache
def _reserved_names() -> frozenset[str]:
    """Parameters of apply_chat_template itself: chat_template_kwargs may not override them."""
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    return frozenset(p.name for p in params if p.kind is not p.VAR_KEYWORD) | {"messages"}


def _arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI sends tool-call arguments as JSON text; templates expect objects (they apply `tojson` themselves).
    Arguments that are not a JSON object stay text. Returns new dicts; the input is not modified."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_call_with_object_args(c) for c in calls]}
        out.append(m)
    return out


def _call_with_object_args(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


def render_chat(tokenizer, chat: ChatSpec, template: str | None = None) -> str:
    """The prompt text for `chat`, rendered with `template` (Jinja source) or else the tokenizer's own template.

    ValueError for input the template cannot take: no messages, conflicting flags, kwargs that shadow
    apply_chat_template's own parameters, or a template that raises.
    """
    if not chat.messages:
        raise ValueError("chat.messages is empty: a chat needs at least one message")
    if chat.continue_final_message and chat.add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    if template is None and not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; start the tokenizer service with "
                         "--chat-template, or send text instead of chat messages")
    shadowed = sorted(set(chat.template_kwargs) & _reserved_names())
    if shadowed:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(shadowed)}")
    try:
        prompt = tokenizer.apply_chat_template(
            _arguments_as_objects(chat.messages), tools=chat.tools, chat_template=template, tokenize=False,
            add_generation_prompt=chat.add_generation_prompt, continue_final_message=chat.continue_final_message,
            **chat.template_kwargs)
    except Exception as e:  # noqa: BLE001 - a template can raise anything on input it does not expect
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from None
    if not isinstance(prompt, str):
        raise ValueError(f"chat template rendered {type(prompt).__name__}, expected text")
    return prompt


def model_template(tokenizer) -> str:
    """The tokenizer's own chat template ("" when it has none)."""
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):  # several named templates: the default one is used for chat
        template = template.get("default", "")
    return template


def template_sha256(template: str) -> str:
    """What GetModelInfo's chat_template_sha256 holds for `template` ("" for none)."""
    return hashlib.sha256(template.encode()).hexdigest() if template else ""


# ---- radixmesh.v1 ChatInput -> ChatSpec (JSON fields parsed here; malformed ones are a ValueError naming the field)
def _json(text: str, what: str, kind: type) -> Any:
    """Parse `text` (non-empty) and check it is a `kind` (list or dict)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, kind):
        expected = "a list" if kind is list else "an object"
        raise ValueError(f"{what} must be {expected}, got {type(value).__name__}")
    return value


def message_from_proto(i: int, m: tokenizer_pb2.ChatMessage) -> dict[str, Any]:
    if not m.role:
        raise ValueError(f"messages[{i}].role is empty")
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_calls_json:
        out["tool_calls"] = _json(m.tool_calls_json, f"messages[{i}].tool_calls_json", list)
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def chat_from_proto(chat: tokenizer_pb2.ChatInput) -> ChatSpec:
    """add_generation_prompt defaults to true, or to false when continuing the final message."""
    tools = _json(chat.tools_json, "tools_json", list) if chat.tools_json else None
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("tools_json must be a list of objects")
    kwargs = _json(chat.chat_template_kwargs_json, "chat_template_kwargs_json", dict) \
        if chat.chat_template_kwargs_json else {}
    add_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") \
        else not chat.continue_final_message
    return ChatSpec(messages=[message_from_proto(i, m) for i, m in enumerate(chat.messages)], tools=tools or None,
                    add_generation_prompt=add_prompt, continue_final_message=chat.continue_final_message,
                    template_kwargs=kwargs)
