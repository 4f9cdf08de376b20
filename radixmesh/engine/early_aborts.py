"""Aborts that arrive before their request reaches the scheduler.

A generate call first prepares its requests on the prep threads (validation, tokenization, grammars) and only then
puts them in the scheduler's inbox. An abort from anyone but the caller (a decode worker whose KV handoff failed at
once, an /abort_request during tokenization) can reach the inbox first; the scheduler finds no such request and
drops it, and the request then runs as if never aborted: a decode-role one waits for KV that never comes. So while
a call with a named rid prepares, aborts of that rid (or of its samples, `<rid>-<index>`) are kept here and applied
right after its requests are submitted."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class EarlyAborts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._preparing: dict[str, int] = {}  # rid named by a call not yet submitted -> how many such calls
        self._pending: dict[str, str | None] = {}  # aborted rid -> its message

    @staticmethod
    def _names(rid) -> list[str]:
        return [rid] if isinstance(rid, str) else [r for r in rid or () if isinstance(r, str)]

    @contextlib.contextmanager
    def preparing(self, rid) -> Iterator[None]:
        """Around a call's preparation and submission; `rid`: its rid(s) as given (None: no one can abort it yet)."""
        names = self._names(rid)
        with self._lock:
            for r in names:
                self._preparing[r] = self._preparing.get(r, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                for r in names:
                    if self._preparing[r] > 1:
                        self._preparing[r] -= 1
                        continue
                    del self._preparing[r]
                    for key in [k for k in self._pending if k == r or k.rpartition("-")[0] == r]:
                        del self._pending[key]

    def note(self, rid: str, message: str | None) -> None:
        """An abort of `rid` is on its way to the scheduler: keep it if the request may not be there yet."""
        with self._lock:
            if rid in self._preparing or rid.rpartition("-")[0] in self._preparing:
                self._pending[rid] = message

    def take(self, rids: list[str]) -> list[tuple[str, str | None]]:
        """The kept aborts of `rids` (just submitted), to send again now that the requests are in the inbox."""
        with self._lock:
            return [(r, self._pending.pop(r)) for r in rids if r in self._pending]
