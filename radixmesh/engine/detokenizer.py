"""Incremental detokenization: text deltas that never end inside a multi-byte character.

Runs in the caller's thread (or event loop), never on the scheduler loop.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text deltas.

    Each push decodes ids[prefix_offset:] and ids[prefix_offset:read_offset] (the already-emitted tokens with one
    step of left context, so boundary merges such as leading spaces come out right) and emits the difference, but
    only when the decoded text does not end in U+FFFD (an incomplete UTF-8 sequence); those bytes wait.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.options = {"skip_special_tokens": skip_special_tokens,
                        "spaces_between_special_tokens": spaces_between_special_tokens}
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.options)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the newly complete text (on `final`, everything still held back)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if (full.endswith("\ufffd") and not final) or len(full) <= len(prefix_text):
            return ""
        delta = full[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
