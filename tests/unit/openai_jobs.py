"""Shared by the OpenAI protocol tests: parse a chat or completions body with the fields a test adds."""

from __future__ import annotations

from radixmesh.services.router.openai_request import parse_chat_completion, parse_completion

SERVED = {"tiny"}
USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return parse_chat_completion({"model": "tiny", "messages": USER, **fields}, SERVED)


def completion(**fields):
    return parse_completion({"model": "tiny", "prompt": "Once", **fields}, SERVED)
