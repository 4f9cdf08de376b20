"""services.router.reasoning: thinking and answer split alike whole and streamed, in any chunking."""

from __future__ import annotations

import random

import pytest

from radixmesh.services.common import thinking
from radixmesh.services.router.reasoning import (REASONING_PARSERS, ReasoningSplitter, closes_reasoning,
                                                 reasoning_format, split_reasoning, starts_in_reasoning)

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek-r1"]


@pytest.mark.parametrize("fmt, text, in_reasoning, expected", [
    (QWEN3, "<think>\nplan it</think>\n\nThe answer.", False, ("\nplan it", "The answer.")),
    (QWEN3, "  <think>a</think>b", False, ("a", "b")),
    (QWEN3, "no thinking here", False, (None, "no thinking here")),
    (QWEN3, "text <think>later</think> tag", False, (None, "text <think>later</think> tag")),
    (QWEN3, "plan</think>\nanswer", True, ("plan", "answer")),
    (QWEN3, "<think>never closed", False, ("never closed", "")),
    (QWEN3, "", True, ("", "")),
    (QWEN3, "<thi", False, (None, "<thi")),
    (R1, "reason</think>answer</think>", True, ("reason", "answer</think>")),
    (R1, "<think>reason</think>\n\nanswer", True, ("reason", "answer")),
    (R1, "", True, ("", "")),
    (R1, "<th", True, ("<th", "")),
    (REASONING_PARSERS["kimi"], "◁think▷x◁/think▷y", False, ("x", "y")),
])
def test_split(fmt, text, in_reasoning, expected):
    assert split_reasoning(fmt, text, in_reasoning) == expected


@pytest.mark.parametrize("seed", range(20))
def test_streamed_pieces_add_up_to_the_whole_split(seed):
    rng = random.Random(seed)
    text = rng.choice(["<think>\nstep one</think>\n\nfinal 🙂 answer </think>", "  <think></think>x",
                       "pla</th</think>ans<", "plain <", "\n\n<think>deep</think>"])
    in_reasoning = rng.random() < 0.5
    splitter = ReasoningSplitter(QWEN3, in_reasoning)
    reasoning, answer, i = "", "", 0
    while i < len(text):
        j = i + rng.randint(1, 4)
        r, a = splitter.feed(text[i:j])
        reasoning, answer, i = reasoning + r, answer + a, j
    r, a = splitter.finish()
    whole = split_reasoning(QWEN3, text, in_reasoning)
    assert (reasoning + r, answer + a) == ((whole[0] or ""), whole[1])


def test_a_partial_end_tag_is_held_back_until_it_resolves():
    s = ReasoningSplitter(QWEN3, True)
    assert s.feed("abc</th") == ("abc", "")
    assert s.feed("ink>\nok") == ("", "ok")
    s = ReasoningSplitter(QWEN3, True)
    assert s.feed("abc</th") == ("abc", "")
    assert s.feed("is") == ("</this", "")


@pytest.mark.parametrize("fmt, prompt, expected", [
    (QWEN3, "<|im_start|>assistant\n", False),
    (QWEN3, "<|im_start|>assistant\n<think>\n", True),
    (QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    (R1, "<｜Assistant｜>", True),
    (R1, "<｜Assistant｜><think>\n", True),
    (R1, "<｜Assistant｜><think>\n\n</think>\n\n", False),
    (R1, "old <think>a</think> turn<｜Assistant｜>", True),
])
def test_starts_in_reasoning(fmt, prompt, expected):
    assert starts_in_reasoning(fmt, prompt) == expected


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="qwen3"):
        reasoning_format("nope")


@pytest.mark.parametrize("prompt, state", [
    ("<|im_start|>assistant\n", thinking.OUTSIDE),
    ("<|im_start|>assistant\n<think>\n", thinking.OPEN),
    ("<|im_start|>assistant\n<think>\nLet me see", thinking.OPEN),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", thinking.CLOSED),
    ("old <think>a</think> turn<|im_start|>assistant\n", thinking.OUTSIDE),
    ("</think> then <think>", thinking.OPEN),
])
def test_where_a_prompt_leaves_the_thinking(prompt, state):
    """The state a worker reports for its rendering, from which the router decides as from the tokenizer service's
    rendering: a format that starts inside the thinking (deepseek-r1) does so unless the prompt closed it."""
    assert thinking.prompt_thinking(prompt, "<think>", "</think>") == state
    for fmt in (QWEN3, R1):
        assert thinking.starts_thinking(state, fmt.force) == starts_in_reasoning(fmt, prompt)
        assert (state == thinking.CLOSED) == closes_reasoning(fmt, prompt)
    # a message that does not say (none of a request's but its first) counts as OUTSIDE
    assert not thinking.starts_thinking(thinking.UNSPECIFIED, False)
    assert thinking.starts_thinking(thinking.UNSPECIFIED, True)
