"""N-gram drafts: the tokens that followed the latest earlier occurrence of the request's own newest tokens, in its
own sequence or in the sequences of requests served before it.

Text that repeats what came before (code being edited, a summary quoting its source, a list continuing its pattern,
a question asked again) makes the longest suffix of the sequence (prompt + output so far) that occurred before a good
guess of what follows: the tokens after that earlier occurrence. A request's index lists, per token id, the positions
where it occurs; the draft comes from the candidate (of the latest few occurrences of the newest token) whose match
with the suffix is longest, between the min and max match window (SGLang's --speculative-ngram-{min,max}-match-
window-size); ties go to the latest. Memory is one int per token of the request, and a step costs at most SCAN x max
window comparisons, whatever the sequence's length.

When the match runs up to the newest tokens (a period shorter than the draft), the draft continues the period:
token i of the draft is the token i + 1 places after the match's end in the sequence extended by the draft itself.

The engine's NgramCorpus is SGLang's n-gram cache across requests: every finished request's prompt and output go
into it (at most --speculative-ngram-capacity tokens, the oldest half dropped when full), and a request drafts from
whichever matches its suffix longer, its own sequence or the corpus (its own on a tie).
"""

from __future__ import annotations

from array import array

SCAN = 32  # latest occurrences of the newest token a draft looks at
_SEPARATOR = -1  # between sequences in a corpus: equals no token, so no match or draft crosses it


def _longest(seq, ends, tokens: list[int], limit: int) -> tuple[int, int | None]:
    """(length, end) of the longest match of the suffix of `tokens` ending at one of `ends` (positions in `seq`
    holding tokens[-1], tried latest first), up to `limit` tokens."""
    n = len(tokens)
    best_len, best_end = 0, None
    for end in reversed(ends[-SCAN:]):
        length = 1
        while length < limit and end - length >= 0 and seq[end - length] == tokens[n - 1 - length]:
            length += 1
        if length > best_len:
            best_len, best_end = length, end
            if length == limit:
                break
    return best_len, best_end


class _Generation:
    """Sequences one after another (separated), with each token id's positions."""

    __slots__ = ("tokens", "positions")

    def __init__(self):
        self.tokens = array("q")
        self.positions: dict[int, array] = {}

    def add(self, seq: list[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(seq)
        self.tokens.append(_SEPARATOR)
        positions = self.positions
        for p, t in enumerate(seq, start):
            where = positions.get(t)
            if where is None:
                where = positions[t] = array("q")
            where.append(p)

    def match(self, tokens: list[int], limit: int) -> tuple[int, int | None]:
        """(length, end) as _longest (an end before a separator has nothing to draft: `after` gives [])."""
        ends = self.positions.get(tokens[-1])
        return _longest(self.tokens, ends, tokens, limit) if ends else (0, None)

    def after(self, end: int, k: int) -> list[int]:
        out = []
        for t in self.tokens[end + 1:end + 1 + k]:
            if t == _SEPARATOR:
                break
            out.append(t)
        return out


class NgramCorpus:
    """Tokens of finished requests, shared by every request's drafts: up to `capacity` tokens in two generations
    (when the newer one holds half, it becomes the older and the older is dropped). Used on the scheduler thread."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.new, self.old = _Generation(), _Generation()

    def add(self, seq: list[int]) -> None:
        if len(seq) < 2:
            return
        half = max(1, self.capacity // 2)
        seq = seq[-half:]
        if len(self.new.tokens) + len(seq) > half:
            self.old, self.new = self.new, _Generation()
        self.new.add(seq)

    def propose(self, tokens: list[int], k: int, min_window: int, max_window: int) -> tuple[int, list[int]]:
        """(match length, up to k tokens) from the generation whose match is longer (the newer on a tie)."""
        limit = min(max_window, len(tokens))
        best = (0, [])
        for gen in (self.new, self.old):
            length, end = gen.match(tokens, limit)
            if length >= min_window and length > best[0]:
                draft = gen.after(end, k)
                if draft:
                    best = (length, draft)
        return best

    @property
    def size(self) -> int:
        """Tokens held (separators included)."""
        return len(self.new.tokens) + len(self.old.tokens)


class NgramIndex:
    """One request's occurrences, grown as its sequence grows (the sequence only ever gets longer, retractions
    included: they keep the output), and the engine's corpus of earlier requests (None: its own sequence only)."""

    __slots__ = ("min_window", "max_window", "positions", "indexed", "corpus")

    def __init__(self, min_window: int, max_window: int, corpus: NgramCorpus | None = None):
        self.min_window, self.max_window = min_window, max_window
        self.positions: dict[int, list[int]] = {}  # token id -> where it occurs, ascending
        self.indexed = 0  # positions [0, indexed) are listed
        self.corpus = corpus

    def _index(self, tokens: list[int], end: int) -> None:
        for p in range(self.indexed, end):
            self.positions.setdefault(tokens[p], []).append(p)
        self.indexed = max(self.indexed, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `tokens` (the request's whole sequence); [] when nothing matches."""
        n = len(tokens)
        if k <= 0 or n < 2:
            return []
        self._index(tokens, n - 1)  # every position but the newest: a suffix must not match itself
        length, end = _longest(tokens, self.positions.get(tokens[-1], ()), tokens, min(self.max_window, n - 1))
        if length < self.min_window:
            length, end = 0, None
        if self.corpus is not None:
            shared, draft = self.corpus.propose(tokens, k, self.min_window, self.max_window)
            if shared > length:
                return draft
        if end is None:
            return []
        draft: list[int] = []
        for i in range(end + 1, end + 1 + k):
            draft.append(tokens[i] if i < n else draft[i - n])
        return draft
