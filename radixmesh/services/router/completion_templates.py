"""Fill-in-the-middle templates for /v1/completions' `suffix` (SGLang's --completion-template): a code model is
given the text before the hole and the text after it between its FIM tokens, and generates the middle.

A template is a built-in name or a JSON file with SGLang's keys: `name`, `fim_begin_token`, `fim_middle_token`,
`fim_end_token` and `fim_position` ("MIDDLE" or "END", where the middle token stands):
  MIDDLE: begin + prompt + middle + suffix + end   (DeepSeek-Coder: the middle token marks the hole)
  END:    begin + prompt + end + suffix + middle   (StarCoder, Qwen2.5-Coder: generation starts after it)"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CompletionTemplate:
    name: str
    begin: str
    middle: str
    end: str
    middle_last: bool  # fim_position END

    def render(self, prompt: str, suffix: str) -> str:
        if self.middle_last:
            return f"{self.begin}{prompt}{self.end}{suffix}{self.middle}"
        return f"{self.begin}{prompt}{self.middle}{suffix}{self.end}"


BUILTIN: dict[str, CompletionTemplate] = {t.name: t for t in (
    CompletionTemplate("deepseek_coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", middle_last=False),
    CompletionTemplate("star_coder", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", middle_last=True),
    CompletionTemplate("qwen_coder", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", middle_last=True),
)}
_KEYS = ("name", "fim_begin_token", "fim_middle_token", "fim_end_token", "fim_position")


@functools.lru_cache(maxsize=8)
def load_completion_template(arg: str) -> CompletionTemplate:
    """A built-in template by name, or one read from a JSON file (once); ValueError saying what is wrong."""
    if arg in BUILTIN:
        return BUILTIN[arg]
    if not os.path.isfile(arg):
        raise ValueError(f"--completion-template must be one of {', '.join(BUILTIN)} or a JSON file, got {arg!r}")
    try:
        with open(arg, encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--completion-template {arg}: not a readable JSON file ({e})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"--completion-template {arg}: expected a JSON object with {', '.join(_KEYS)}")
    missing = [k for k in _KEYS if not isinstance(spec.get(k), str) or not spec[k]]
    if missing:
        raise ValueError(f"--completion-template {arg}: {', '.join(missing)} must be non-empty strings")
    position = spec["fim_position"].upper()
    if position not in ("MIDDLE", "END"):
        raise ValueError(f"--completion-template {arg}: fim_position must be MIDDLE or END, got "
                         f"{spec['fim_position']!r}")
    return CompletionTemplate(spec["name"], spec["fim_begin_token"], spec["fim_middle_token"],
                              spec["fim_end_token"], middle_last=position == "END")
