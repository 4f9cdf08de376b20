"""Where a rendered chat prompt leaves a reasoning model's thinking block, and what follows from it: whether the
output starts inside the thinking, and which tokens gate a constraint to the answer. The router decides so for
prompts the tokenizer service rendered, a worker for chat prompts it renders itself (GenerateRequest.reasoning_tags,
answered in GenerateResponse.prompt_thinking); one code for both, so either path parses and constrains alike."""

from __future__ import annotations

from typing import NamedTuple

from radixmesh.v1 import worker_pb2

UNSPECIFIED = worker_pb2.PROMPT_THINKING_UNSPECIFIED
OPEN = worker_pb2.PROMPT_THINKING_OPEN
CLOSED = worker_pb2.PROMPT_THINKING_CLOSED
OUTSIDE = worker_pb2.PROMPT_THINKING_OUTSIDE


class Gate(NamedTuple):
    """A constraint's reasoning gate: the token that ends the thinking, and the one that may open it as the output's
    first token (None: the output starts inside the thinking)."""

    start: int | None
    end: int


def prompt_thinking(prompt: str, start: str, end: str) -> int:
    """OPEN when the prompt's last `start` tag comes after its last `end` tag, CLOSED when it ends with an `end` tag
    (whitespace aside), else OUTSIDE. Tags are non-empty."""
    closed = prompt.rfind(end)
    if prompt.rfind(start) > closed:
        return OPEN
    if closed >= 0 and not prompt[closed + len(end):].strip():
        return CLOSED
    return OUTSIDE


def starts_thinking(state: int, starts_inside: bool) -> bool:
    """Whether the output begins inside the thinking: where the prompt opened it, or for a format whose output
    starts inside it (`starts_inside`) unless the prompt closed it. UNSPECIFIED counts as OUTSIDE."""
    return state == OPEN or (starts_inside and state != CLOSED)


def answer_gate(state: int, starts_inside: bool, start_id: int | None, end_id: int | None) -> Gate | None:
    """The gate of a constraint that binds the answer only, from the tags' token ids (None where a tag is not one
    token): None (the constraint binds the whole output) when the prompt closed the thinking, when the end tag is
    not one token, or when the output starts outside the thinking and the start tag is not one token."""
    if end_id is None or state == CLOSED:
        return None
    if starts_thinking(state, starts_inside):
        return Gate(None, end_id)
    return None if start_id is None else Gate(start_id, end_id)


def regate(sampling, state: int, starts_inside: bool) -> None:
    """A worker's side of answer_gate: `sampling` (common_pb2.SamplingParams) carries the tags' token ids as the
    router sent them with reasoning_tags; keeps of them what answer_gate gives for the rendering's `state`
    (modifies `sampling`)."""
    if not sampling.HasField("reasoning_end_token_id"):
        return
    start = sampling.reasoning_start_token_id if sampling.HasField("reasoning_start_token_id") else None
    gate = answer_gate(state, starts_inside, start, sampling.reasoning_end_token_id)
    if gate is None:
        sampling.ClearField("reasoning_end_token_id")
    if gate is None or gate.start is None:
        sampling.ClearField("reasoning_start_token_id")
