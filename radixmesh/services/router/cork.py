"""Coalesced writes of a streamed HTTP response: the events of worker messages that are already in the router go out in
one write (one send, one HTTP chunk) instead of one each.

A busy router reads a worker's stream in bursts: a read of the stream lane or of gRPC often holds several steps, so
several messages of one request are queued when its handler wakes. Writing each event on its own costs a trip through
aiohttp's writer and a `send` per token, the largest single cost of a streamed token. With a Cork, the handler's
events are held only while the worker call it reads from (services.router.mux.MuxCall) says more of its messages are
already queued (`more`), and the call flushes them before it would wait for the worker; any other source of messages
never sets `more`, so its events are written at once, as before. The bytes the client reads are the same; only how
they are cut into TCP segments and HTTP chunks changes. An idle router sees one message at a time and writes each at
once, so coalescing costs no latency: it happens only while messages are waiting anyway.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Awaitable, Callable

_current: contextvars.ContextVar["Cork | None"] = contextvars.ContextVar("radixmesh_cork", default=None)


class Cork:
    __slots__ = ("task", "more", "_parts", "send", "end", "_token")

    def __init__(self) -> None:
        self.task = asyncio.current_task()
        self.more = False  # set by the worker call the handler reads: more of its messages are already here
        self.send: Callable[[bytes], Awaitable[None]] | None = None  # the response's write, once it started
        self.end: Callable[[bytes], Awaitable[None]] | None = None  # and its write_eof
        self._parts: list[bytes] = []
        self._token: contextvars.Token | None = None

    def start(self, response) -> None:
        """The response (a prepared aiohttp StreamResponse) that the events go to."""
        self.send, self.end = response.write, response.write_eof

    async def close(self, last: bytes) -> None:
        """Writes what is held and `last`, and ends the response, in one write (with the chunked encoding's
        terminator: a streamed response's last send carries its last event)."""
        self._parts.append(last)
        data = b"".join(self._parts)
        self._parts.clear()
        self.more = False
        await self.end(data)

    async def write(self, data: bytes) -> None:
        """Writes `data` now, or with what follows when more messages are already queued."""
        if data:
            self._parts.append(data)
        if not self.more:
            await self.flush()

    async def flush(self) -> None:
        if self._parts and self.send is not None:
            data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
            self._parts.clear()
            await self.send(data)

    def __enter__(self) -> "Cork":
        self._token = _current.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _current.reset(self._token)


def mine() -> Cork | None:
    """The Cork of the handler whose task runs now (None outside one, and in the tasks it spawns: merged streams)."""
    cork = _current.get()
    return cork if cork is not None and cork.task is asyncio.current_task() else None
