"""radixmesh.v1 tokenizer messages <-> the tokenizer service's Python types. JSON fields are parsed here;
malformed ones are a ValueError naming the field."""

from __future__ import annotations

import json
from typing import Any

from radixmesh.v1 import tokenizer_pb2
from radixmesh.services.tokenizer.backend import TokenizerInfo, Tokenized
from radixmesh.services.tokenizer.chat import ChatSpec


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


def optional_bool(msg, name: str, default: bool) -> bool:
    return getattr(msg, name) if msg.HasField(name) else default


def tokenized_to_proto(out: Tokenized) -> tokenizer_pb2.TokenizeResponse:
    return tokenizer_pb2.TokenizeResponse(input_ids=out.input_ids, prompt=out.prompt)


def info_to_proto(info: TokenizerInfo) -> tokenizer_pb2.GetTokenizerInfoResponse:
    return tokenizer_pb2.GetTokenizerInfoResponse(
        vocab_size=info.vocab_size,
        special_tokens=[tokenizer_pb2.SpecialToken(name=t.name, content=t.content, id=t.id)
                        for t in info.special_tokens],
        chat_template=info.chat_template,
        tokenizer_path=info.tokenizer_path,
        eos_token_ids=list(info.eos_token_ids),
        context_length=info.context_length,
    )
