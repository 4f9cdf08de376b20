"""N-gram drafts: the tokens that followed the latest earlier occurrence of the request's own newest tokens.

Text that repeats what came before (code being edited, a summary quoting its source, a list continuing its pattern)
makes the longest suffix of the sequence (prompt + output so far) that occurred before a good guess of what follows:
the tokens after that earlier occurrence. A request's index lists, per token id, the positions where it occurs;
the draft comes from the candidate (of the latest few occurrences of the newest token) whose match with the suffix
is longest, between the min and max match window (SGLang's --speculative-ngram-{min,max}-match-window-size); ties
go to the latest. Memory is one int per token of the request, and a step costs at most SCAN x max window
comparisons, whatever the sequence's length.

When the match runs up to the newest tokens (a period shorter than the draft), the draft continues the period:
token i of the draft is the token i + 1 places after the match's end in the sequence extended by the draft itself.
"""

from __future__ import annotations

SCAN = 32  # latest occurrences of the newest token a draft looks at


class NgramIndex:
    """One request's occurrences, grown as its sequence grows (the sequence only ever gets longer, retractions
    included: they keep the output)."""

    __slots__ = ("min_window", "max_window", "positions", "indexed")

    def __init__(self, min_window: int, max_window: int):
        self.min_window, self.max_window = min_window, max_window
        self.positions: dict[int, list[int]] = {}  # token id -> where it occurs, ascending
        self.indexed = 0  # positions [0, indexed) are listed

    def _index(self, tokens: list[int], end: int) -> None:
        for p in range(self.indexed, end):
            self.positions.setdefault(tokens[p], []).append(p)
        self.indexed = max(self.indexed, end)

    def _match(self, tokens: list[int]) -> int | None:
        """The end of the earlier occurrence that best matches the sequence's suffix, or None."""
        n = len(tokens)
        best_len, best_end = 0, None
        limit = min(self.max_window, n - 1)
        for end in reversed(self.positions.get(tokens[-1], ())[-SCAN:]):
            length = 1
            while length < limit and end - length >= 0 and tokens[end - length] == tokens[n - 1 - length]:
                length += 1
            if length > best_len:
                best_len, best_end = length, end
                if length == limit:
                    break
        return best_end if best_len >= self.min_window else None

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `tokens` (the request's whole sequence); [] when nothing matches."""
        n = len(tokens)
        if k <= 0 or n < 2:
            return []
        self._index(tokens, n - 1)  # every position but the newest: a suffix must not match itself
        end = self._match(tokens)
        if end is None:
            return []
        draft: list[int] = []
        for i in range(end + 1, end + 1 + k):
            draft.append(tokens[i] if i < n else draft[i - n])
        return draft
