"""Chat prompts: messages + tools rendered by the tokenizer's chat template (or the --chat-template override).

Rendering produces text; tokenizing it must not add special tokens again, because templates write BOS themselves.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass, field
from typing import Any


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
