"""KV events: pages entering and leaving each tier of a worker's prefix cache, for the global prefix index.

The cache manager appends events from the scheduler thread; subscribers (a worker's SubscribeKvEvents streams) read
them from other threads. Sequence numbers start at 1 and never repeat while the process lives. The log keeps the last
`capacity` events; a subscriber that fell further behind starts over from a snapshot.
"""

from __future__ import annotations

import collections
import enum
import threading
from dataclasses import dataclass
from typing import Callable


class Tier(enum.IntEnum):
    DEVICE = 1
    HOST = 2


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class KvEvent:
    sequence: int
    kind: EventKind
    tier: Tier | None = None
    page_keys: tuple[bytes, ...] = ()
    parent_key: bytes = b""
    token_ids: tuple[int, ...] = ()  # STORED: the pages' tokens
    page_size: int = 0


class KvEventLog:
    def __init__(self, page_size: int, capacity: int = 65536):
        self.page_size = page_size
        self._events: collections.deque[KvEvent] = collections.deque(maxlen=capacity)
        self._seq = 0
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    @property
    def sequence(self) -> int:
        return self._seq

    def stored(self, tier: Tier, keys: list[bytes], parent: bytes, tokens: list[int]) -> None:
        self._append(EventKind.STORED, tier, tuple(keys), parent, tuple(tokens))

    def removed(self, tier: Tier, keys: list[bytes]) -> None:
        self._append(EventKind.REMOVED, tier, tuple(keys))

    def cleared(self) -> None:
        self._append(EventKind.CLEARED)

    def _append(self, kind: EventKind, tier: Tier | None = None, keys: tuple = (), parent: bytes = b"",
                tokens: tuple = ()) -> None:
        if kind is not EventKind.CLEARED and not keys:
            return
        with self._lock:
            self._seq += 1
            self._events.append(KvEvent(self._seq, kind, tier, keys, parent, tokens, self.page_size))
            listeners = list(self._listeners)
        for wake in listeners:
            wake()

    def since(self, sequence: int) -> list[KvEvent] | None:
        """Events after `sequence`, oldest first; None when some of them are no longer kept, or when `sequence` is
        from the future (a subscriber of an earlier process): start over from a snapshot then."""
        with self._lock:
            if sequence > self._seq:
                return None
            if sequence == self._seq:
                return []
            if not self._events or self._events[0].sequence > sequence + 1:
                return None
            return [e for e in self._events if e.sequence > sequence]

    def listen(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake()` (from the appending thread) after each new event; returns the function that stops it."""
        with self._lock:
            self._listeners.append(wake)

        def stop() -> None:
            with self._lock:
                if wake in self._listeners:
                    self._listeners.remove(wake)
        return stop
