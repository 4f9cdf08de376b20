"""Reasoning parsers (SGLang's --reasoning-parser): split a model's output into its thinking and its answer.

A format names the tags around the thinking and whether the output starts inside it. Whether a sample starts in
its thinking is decided per request from the rendered prompt (services/common/thinking.py, which a worker that
renders the chat itself runs too): a prompt whose last think tag is an opening one (the template opened the block,
as Qwen3's thinking-only and DeepSeek-R1's templates do) starts inside; one whose template already closed it (Qwen3
with enable_thinking=false) does not; `force` formats start inside unless the prompt closed the block. An opening
tag at the very start of the output (after whitespace) enters the thinking too, or is dropped when the output starts
inside it (older DeepSeek-R1 outputs repeat the template's tag).

The splitter works on streamed text: `feed` returns (reasoning, answer) pieces as soon as they are certain, holding
back only a possible partial tag; `finish` flushes. Whole outputs go through the same code, so streamed and whole
results are equal. Output that never closes its thinking is all reasoning (the answer is empty), as SGLang does."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.services.common.thinking import CLOSED, prompt_thinking, starts_thinking


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    start: str
    end: str
    force: bool  # the output starts inside the thinking unless the prompt closed it
    channels: bool = False  # GPT-OSS's harmony messages (services.router.harmony), read by channel, not by tags


_THINK = ("<think>", "</think>")
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat(*_THINK, force=False),
    "qwen3-thinking": ReasoningFormat(*_THINK, force=True),
    "deepseek-r1": ReasoningFormat(*_THINK, force=True),
    "deepseek-v3": ReasoningFormat(*_THINK, force=False),
    "glm45": ReasoningFormat(*_THINK, force=False),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷", force=False),
    # an analysis message's header and end: where a rendered prompt leaves the thinking, and a constraint's gate
    # (its end is one token; the output opens the analysis itself, with a header of several tokens: a constraint
    # binds the whole output unless the prompt opened the analysis)
    "gpt-oss": ReasoningFormat("<|channel|>analysis<|message|>", "<|end|>", force=False, channels=True),
}


def reasoning_format(name: str) -> ReasoningFormat:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}") from None


def starts_in_reasoning(fmt: ReasoningFormat, prompt: str) -> bool:
    """Whether the output of `prompt` (the rendered chat prompt) begins inside the thinking block."""
    return starts_thinking(prompt_thinking(prompt, fmt.start, fmt.end), fmt.force)


def closes_reasoning(fmt: ReasoningFormat, prompt: str) -> bool:
    """Whether the rendered prompt ends by closing the thinking block (Qwen3 with enable_thinking=false): the
    output is all answer."""
    return prompt_thinking(prompt, fmt.start, fmt.end) == CLOSED


def _held(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """One sample's output, streamed: feed() pieces in order, then finish()."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool) -> None:
        self.fmt = fmt
        self.state = "start"  # start -> thinking -> answer, or start -> answer
        self.after_start = "thinking" if in_reasoning else "answer"  # where output without an opening tag goes
        self.thought = in_reasoning  # whether the output had a thinking part (even an empty one)
        self.pending = ""
        self.answer_started = False  # the answer's leading newlines are dropped

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, answer = [], []
        while self.pending:
            if self.state == "start":
                stripped = self.pending.lstrip()
                if stripped.startswith(self.fmt.start):
                    self.pending = stripped[len(self.fmt.start):]
                    self.state, self.thought = "thinking", True
                elif not stripped or self.fmt.start.startswith(stripped):
                    break  # could still become the opening tag
                else:
                    self.state = self.after_start
            elif self.state == "thinking":
                at = self.pending.find(self.fmt.end)
                if at < 0:
                    keep = _held(self.pending, self.fmt.end)
                    reasoning.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                reasoning.append(self.pending[:at])
                self.pending = self.pending[at + len(self.fmt.end):]
                self.state = "answer"
            else:
                if not self.answer_started:
                    self.pending = self.pending.lstrip("\n")
                    if not self.pending:
                        break
                    self.answer_started = True
                answer.append(self.pending)
                self.pending = ""
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What was held back: a partial tag that never completed is text of the part it was in."""
        rest, self.pending = self.pending, ""
        state = self.after_start if self.state == "start" else self.state
        if state == "thinking":
            return rest, ""
        if self.state == "start":
            return "", rest
        return "", rest if self.answer_started else rest.lstrip("\n")


def split_reasoning(fmt: ReasoningFormat, text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """(reasoning or None when there was none, answer) of a whole output."""
    splitter = ReasoningSplitter(fmt, in_reasoning)
    r1, a1 = splitter.feed(text)
    r2, a2 = splitter.finish()
    return (r1 + r2 if splitter.thought else None), a1 + a2
